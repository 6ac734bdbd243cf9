"""The trainer's rebuild of the sampler's distribution, against vLLM's own masking code
and against arithmetic done by hand."""

import math

import pytest
import torch

from train_batches import as_trained, TrainSample, Turn

from flexmarl.runtime import protocol as p
from flexmarl.workers.trainer.sampling import entropy, sampler_log_probs, truncated, turn_settings


def test_top_k_then_top_p_keeps_what_the_hand_arithmetic_keeps():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0, 2.0]])
    # top_k = 3 keeps 3, 2, 1 (tokens 0, 4, 1): probabilities e^3, e^2, e^1 over their sum
    # are 0.665, 0.245, 0.090. top_p = 0.8: 0.665 < 0.8, 0.665 + 0.245 >= 0.8, so 0 and 4.
    drop = truncated(logits, torch.tensor([3]), torch.tensor([0.8]))
    assert drop.tolist() == [[False, True, True, True, False]]
    assert truncated(logits, torch.tensor([0]), torch.tensor([1.0])).sum() == 0  # no cut
    assert truncated(logits, torch.tensor([0]), torch.tensor([0.1])).tolist() == [[False, True, True, True, True]]
    # Ties with the k-th largest are kept, as vLLM keeps them.
    tied = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    assert truncated(tied, torch.tensor([1]), torch.tensor([1.0])).tolist() == [[True, False, False, True]]


def test_log_probs_are_renormalised_over_the_kept_set_and_the_sampled_token_always_stays():
    logits = torch.tensor([[[3.0, 1.0, 0.0, -1.0, 2.0], [3.0, 1.0, 0.0, -1.0, 2.0]]])
    targets = torch.tensor([[4, 3]])  # token 3 is outside the cut: kept anyway
    lp = sampler_log_probs(logits, targets, torch.full((1, 2), 0.5), torch.tensor([[2, 2]]),
                           torch.tensor([[1.0, 1.0]]))
    z0 = math.exp(6.0) + math.exp(4.0)
    assert lp[0, 0, 4].item() == pytest.approx(4.0 - math.log(z0), abs=1e-6)
    assert lp[0, 0, 1].item() == float("-inf")
    z1 = z0 + math.exp(-2.0)
    assert lp[0, 1, 3].item() == pytest.approx(-2.0 - math.log(z1), abs=1e-6)
    assert torch.isfinite(entropy(lp)).all()


def test_each_turn_reads_its_own_settings_from_its_start_and_greedy_turns_are_uncut():
    s = TrainSample("c", [1], [5, 6, 7, 8, 9], 1.0, [], [0, 0, 0], 0.9, [1, 1, 0, 1, 1], 0.7, 0,
                      [Turn(3, 0.3, 1.0, 5), Turn(4, 0.0, 0.5, 2)])
    temperature, top_k, top_p = turn_settings(as_trained([s]), 6)
    assert temperature.tolist()[0] == pytest.approx([0.9, 0.9, 0.9, 0.3, 1.0, 1.0])
    assert top_k.tolist() == [[0, 0, 0, 5, 0, 0]]
    assert top_p.tolist()[0] == pytest.approx([0.7, 0.7, 0.7, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("top_k, top_p", [(0, 0.7), (5, 1.0), (5, 0.7), (40, 0.95), (1, 1.0)])
def test_the_cut_is_vllms_own_on_random_logits(top_k, top_p):
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(64, 300, generator=g) * 3 / 0.8
    k = torch.full((64,), top_k if top_k else 300, dtype=torch.int32)
    want = ops.apply_top_k_top_p_pytorch(logits.clone(), k if top_k else None,
                                         torch.full((64,), top_p) if top_p < 1 else None, allow_cpu_sync=True)
    got = truncated(logits, torch.full((64,), top_k), torch.full((64,), top_p))
    assert torch.equal(got, torch.isinf(want))
