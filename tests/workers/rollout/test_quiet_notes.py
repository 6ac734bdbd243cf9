"""What an engine's start logs that nobody can act on (vLLM's Triton notes on a CPU, its
warnings about FlexMARL's own engine settings) is dropped; everything else is kept. The
short real-process runs check the rollout workers' logs hold no Triton note."""

import logging
import warnings

from flexmarl.workers.rollout.engine import QUIET_NOTES, quiet_notes


def test_the_notes_are_dropped_and_other_messages_of_the_same_loggers_kept(caplog):
    quiet_notes()
    quiet_notes()  # once per logger, however often engines start
    assert all(len(logging.getLogger(name).filters) == 1 for name in QUIET_NOTES)
    with caplog.at_level(logging.INFO, logger="vllm"):
        logging.getLogger("vllm.triton_utils.importing").warning("Triton is installed, but doesn't include CPU backend.")
        logging.getLogger("vllm.platforms.cpu").warning("Triton is not installed. triton-cpu is expected on x86 CPUs.")
        logging.getLogger("vllm.engine.arg_utils").warning("The global random seed is set to %d.", 0)
        logging.getLogger("vllm.platforms.cpu").warning("VLLM_CPU_KVCACHE_SPACE is too small")
    assert [r.getMessage() for r in caplog.records] == ["VLLM_CPU_KVCACHE_SPACE is too small"]


def test_torchs_deprecation_inside_vllm_is_not_shown():
    quiet_notes()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        quiet_notes()
        warnings.warn("`torch.distributed.reduce_op` is deprecated, please use ReduceOp", FutureWarning)
        warnings.warn("something else", FutureWarning)
    assert [str(w.message) for w in shown] == ["something else"]
