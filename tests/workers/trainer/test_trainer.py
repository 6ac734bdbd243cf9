"""The trainer's command handlers, run directly (no processes): training states swap
byte-exactly (the step in progress with them), a damaged parked copy is refused without side
effects, a step covering other samples than the controller meant is refused, and each step
reports what it trained on."""

import random
from pathlib import Path

import msgspec
import pytest
import torch

from train_batches import TrainSample, micro_batch

from flexmarl.controller.tasks import digit_chain
from flexmarl.runtime import protocol as p
from flexmarl.runtime.params.channel import ParamHandle, ParamTransferError
from flexmarl.workers import models
from flexmarl.workers.trainer.worker import TrainerHandler, training_state


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return models.build_model(digit_chain.AGENTS["planner"], digit_chain.VOCAB,
                              tmp_path_factory.mktemp("planner"))


def sample(i, rng, version):
    query = digit_chain.make_query(rng)
    return TrainSample(f"s{i}", digit_chain.planner_prompt(query), digit_chain.make_query(rng),
                         rng.uniform(-1, 1), [-1.0, -1.0, -1.0], [version])


def trained_handler(model_dir, steps=2):
    h = TrainerHandler()
    h._execute(p.InitAgent(1, "planner", str(model_dir), 1e-3, 0))
    rng = random.Random(0)
    for v in range(1, steps + 1):
        h._execute(micro_batch(2, "planner", v, [sample(i, rng, v - 1) for i in range(8)]))
        h._execute(p.OptimStep(3, "planner", v, samples=8))
    # leave gradients pending, so the swap must carry them too
    h._execute(micro_batch(4, "planner", steps + 1, [sample(i, rng, steps) for i in range(8)]))
    return h


def snapshot(h):
    state = h.agents["planner"]
    return {k: v.clone() for k, v in training_state(state.model, state.optimizer).items()}


def test_a_swapped_training_state_comes_back_byte_exact(model_dir):
    h = trained_handler(model_dir)
    before = snapshot(h)
    assert any(k.startswith("grad/") for k in before) and any(k.startswith("optim/") for k in before)
    out = h._execute(p.OffloadAgent(5, "planner"))
    assert "planner" not in h.agents
    other = TrainerHandler()  # another trainer takes it over
    other._execute(p.LoadAgent(6, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    after = snapshot(other)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not other.agents["planner"].adapter  # a whole model: no base to leave
    h._execute(p.ReleaseState(7, "planner", out.handle))
    # and it keeps training from exactly where it was
    other._execute(p.OptimStep(8, "planner", out.version + 1, samples=8))
    assert other.agents["planner"].version == out.version + 1
    h.close(), other.close()


def test_a_swap_in_copies_the_parked_state_into_weights_it_never_initialised(model_dir, monkeypatch):
    # Random init of a 0.5B model takes longer than copying its state in; it is wasted work.
    from transformers.models.llama import modeling_llama

    h = trained_handler(model_dir)
    out = h._execute(p.OffloadAgent(5, "planner"))
    initialised = []
    original = modeling_llama.LlamaPreTrainedModel._init_weights
    monkeypatch.setattr(modeling_llama.LlamaPreTrainedModel, "_init_weights",
                        lambda self, module: (initialised.append(type(module).__name__), original(self, module)))
    other = TrainerHandler()
    other._execute(p.LoadAgent(6, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    assert initialised == []
    assert other.agents["planner"].version == out.version
    h.close(), other.close()


def test_a_swap_in_skeleton_of_a_tied_model_has_the_parameters_and_tie_of_the_model(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from flexmarl.workers.trainer.worker import model_skeleton

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = model_skeleton(str(tmp_path), torch.float32)
    initialised = AutoModelForCausalLM.from_config(config)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in initialised.named_parameters()]
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_corrupted_parked_copy_is_refused_and_nothing_is_trained_on_it(model_dir):
    h = trained_handler(model_dir)
    out = h._execute(p.OffloadAgent(5, "planner"))
    handle = out.handle
    assert isinstance(handle, ParamHandle)  # typed in the reply, as the controller receives it
    segment = Path(handle.path)  # the shared-memory file holding the parked copy
    with open(segment, "r+b") as fh:
        fh.seek(segment.stat().st_size - 100)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    other = TrainerHandler()
    with pytest.raises(ParamTransferError):
        other._execute(p.LoadAgent(6, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    assert "planner" not in other.agents
    with pytest.raises(KeyError, match="not resident"):
        other._execute(micro_batch(7, "planner", out.version + 1, []))
    with open(segment, "r+b") as fh:  # repair: the parked copy was kept, a retry succeeds
        fh.seek(segment.stat().st_size - 100)
        fh.write(byte)
    other._execute(p.LoadAgent(8, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    assert "planner" in other.agents
    h.close(), other.close()


def test_weights_are_published_over_shm_where_they_live_and_the_next_step_ends_the_publication(model_dir):
    from flexmarl.runtime.params.channel import ParamChannel

    shm, plain = trained_handler(model_dir), trained_handler(model_dir)
    for h in (shm, plain):
        h._execute(p.OptimStep(5, "planner", 3, samples=8))
    v3 = shm._execute(p.PublishWeights(6, "planner", 3, "shm", ["r"])).handle
    plain._execute(p.PublishWeights(6, "planner", 3, "tcp", ["r"]))
    state = shm.agents["planner"]
    assert v3.path == state.shared.bucket.segment.path  # sealed where the weights live: no copy
    weights = lambda h: dict(h.agents["planner"].model.named_parameters())  # noqa: E731
    batch = [sample(i, random.Random(1), 3) for i in range(8)]
    with ParamChannel() as receiver:
        got = receiver.receive(v3)
        assert got.keys() == weights(shm).keys() and all(torch.equal(got[k], v) for k, v in weights(shm).items())
        del got
        receiver.release(v3)
        for h in (shm, plain):
            h._execute(micro_batch(7, "planner", 4, batch))
            h._execute(p.OptimStep(8, "planner", 4, samples=8))
        with pytest.raises(ParamTransferError, match="no longer holds this publication"):
            receiver.receive(v3)  # the step ended it: the weights changed where it was
        v4 = shm._execute(p.PublishWeights(9, "planner", 4, "shm", ["r"])).handle
        got = receiver.receive(v4)
        assert all(torch.equal(got[k], v) for k, v in weights(shm).items())
        # Published over shm or tcp, trained in shared memory or not, the arithmetic is the same.
        assert all(torch.equal(got[k], v) for k, v in weights(plain).items())
    shm.close(), plain.close()


def fresh_handler(model_dir, max_grad_norm=1.0):
    h = TrainerHandler()
    h._execute(p.InitAgent(1, "planner", str(model_dir), 1e-3, 0, max_grad_norm))
    return h


def grads(h):
    return {n: q.grad.clone() for n, q in h.agents["planner"].model.named_parameters() if q.grad is not None}


def test_a_step_covering_other_samples_than_the_controller_meant_is_refused_and_not_applied(model_dir):
    h = fresh_handler(model_dir)
    rng = random.Random(0)
    h._execute(micro_batch(2, "planner", 1, [sample(i, rng, 0) for i in range(8)]))
    weights, pending = snapshot(h), grads(h)
    for wrong in (p.OptimStep(3, "planner", 1, samples=7), p.OptimStep(3, "planner", 1, samples=9),
                  p.OptimStep(3, "planner", 1, samples=0)):
        with pytest.raises(ValueError, match="should cover .* samples, but 8 were trained"):
            h._execute(wrong)
    state = h.agents["planner"]
    assert state.version == 0 and state.accumulated == 8
    assert all(torch.equal(weights[k], v) for k, v in snapshot(h).items())
    assert all(torch.equal(pending[k], v) for k, v in grads(h).items())
    done = h._execute(p.OptimStep(4, "planner", 1, samples=8))
    assert done.version == 1 and done.stats.samples == 8 and state.accumulated == 0
    h.close()


def test_what_a_step_in_progress_covers_survives_a_swap(model_dir):
    """Half the batch trained here, half on another trainer after a swap: the step there
    covers all of it, token-mean normalised over all of its tokens, exactly as if the
    whole batch had been one micro-batch on one trainer."""
    rng = random.Random(3)
    batch = [sample(i, rng, 0) for i in range(8)]
    for i in range(0, 8, 2):  # outputs of different lengths, so token_mean differs from seq_mean
        batch[i] = TrainSample(batch[i].sample_id, batch[i].prompt_ids, batch[i].output_ids[:1],
                                 batch[i].advantage, [-1.0], [0])
    token_mean = p.LossOptions("token_mean")
    whole = fresh_handler(model_dir)
    whole._execute(micro_batch(2, "planner", 1, batch, loss=token_mean))
    want = whole._execute(p.OptimStep(3, "planner", 1, samples=8))

    h = fresh_handler(model_dir)
    h._execute(micro_batch(2, "planner", 1, batch[:4], loss=token_mean))
    out = h._execute(p.OffloadAgent(5, "planner"))
    assert out.accumulated == 4
    other = TrainerHandler()
    other._execute(p.LoadAgent(6, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    other._execute(micro_batch(7, "planner", 1, batch[4:], loss=token_mean))
    with pytest.raises(ValueError, match="should cover 4 samples, but 8"):
        other._execute(p.OptimStep(8, "planner", 1, samples=4))
    got = other._execute(p.OptimStep(8, "planner", 1, samples=8))
    assert got.stats.samples == 8 and got.stats.tokens == want.stats.tokens == 4 * 1 + 4 * 3
    assert got.stats.response_len_max == 3 and got.stats.response_len_mean == 2.0
    assert got.stats.loss == pytest.approx(want.stats.loss, rel=1e-5)
    # The two sums of the same gradients differ by float32 round-off (another order). Adam's
    # first step moves each weight by lr * g / (|g| + eps), at most lr: an element whose
    # gradient is near eps turns that round-off into a visible share of lr. A lost or
    # doubled sample moves the loss and token counts checked above; here round-off is
    # bounded by a hundredth of the step, as in the trainer group's comparison.
    adam_round_off = 1e-2 * 1e-3  # of lr = 1e-3 (fresh_handler)
    for a, b in zip(whole.agents["planner"].model.parameters(), other.agents["planner"].model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=adam_round_off)
    # a parked copy whose count disagrees with the controller's is not loaded
    with pytest.raises(ValueError, match="gradients of 4 samples, the controller says 3"):
        TrainerHandler()._execute(p.LoadAgent(9, "planner", str(model_dir), 1e-3, 1.0, out.version, 3, out.handle))
    h._execute(p.ReleaseState(10, "planner", out.handle))
    whole.close(), h.close(), other.close()


def test_step_stats_report_the_gradient_norm_before_clipping(model_dir):
    h = fresh_handler(model_dir, max_grad_norm=1e-4)
    rng = random.Random(1)
    h._execute(micro_batch(2, "planner", 1, [sample(i, rng, 0) for i in range(8)]))
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g / 8) for g in grads(h).values()]))
    done = h._execute(p.OptimStep(3, "planner", 1, samples=8))
    assert done.stats.grad_norm == pytest.approx(float(want), rel=1e-5) and done.grad_norm == done.stats.grad_norm
    assert done.stats.grad_norm > 1e-4
    h.close()


def test_samples_are_scored_under_the_temperature_they_were_sampled_at(model_dir):
    h = fresh_handler(model_dir)
    model = h.agents["planner"].model
    rng = random.Random(2)
    batch = []
    for i in range(4):
        s = sample(i, rng, 0)
        ids = torch.tensor([s.prompt_ids + s.output_ids])
        with torch.no_grad():  # what a sampler at temperature 0.7 reports for these tokens
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / 0.7, -1)
        start = len(s.prompt_ids) - 1
        sampler_lp = [lp[start + j, t].item() for j, t in enumerate(s.output_ids)]
        batch.append(TrainSample(s.sample_id, s.prompt_ids, s.output_ids, s.advantage, sampler_lp, [0], 0.7))
    h._execute(micro_batch(2, "planner", 1, batch, max_staleness=1))
    stats = h._execute(p.OptimStep(3, "planner", 1, samples=4)).stats
    assert stats.logprob_abs_diff < 1e-5 and abs(stats.rollout_kl) < 1e-5 and stats.clip_frac == 0
    h.close()


def test_a_group_sent_without_its_sampling_settings_is_scored_at_temperature_one_every_token_trained():
    bare = msgspec.msgpack.encode([["e", "a", "g"], p.packed("i", [1]), [1], p.packed("i", [2]), b"", [0.5], [0]])
    group = msgspec.msgpack.decode(bare, type=p.TrainGroup)
    assert (group.temperature, group.top_p, group.top_k, group.loss_mask, group.turns) == (1.0, 1.0, 0, b"", [])


def test_the_kl_reference_is_the_initial_weights_even_after_a_swap(model_dir):
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    h = fresh_handler(model_dir)
    rng = random.Random(4)
    kl = p.LossOptions(kl_coef=0.1)
    h._execute(micro_batch(2, "planner", 1, [sample(i, rng, 0) for i in range(4)], loss=kl))
    assert h._execute(p.OptimStep(3, "planner", 1, samples=4)).stats.ref_kl == 0.0  # policy = reference
    out = h._execute(p.OffloadAgent(4, "planner"))  # the reference is not parked ...
    other = TrainerHandler()
    other._execute(p.LoadAgent(5, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    other._execute(micro_batch(6, "planner", 2, [sample(i, rng, 1) for i in range(4)], loss=kl))
    assert other._execute(p.OptimStep(7, "planner", 2, samples=4)).stats.ref_kl > 0
    reference = other.agents["planner"].reference.state_dict()  # ... but rebuilt from the model path
    assert all(torch.equal(reference[k], v) for k, v in initial.items())
    h._execute(p.ReleaseState(8, "planner", out.handle))
    h.close(), other.close()


def test_every_trainer_command_is_queued_and_dispatched_through_one_table(model_dir):
    import asyncio

    to_trainer = {p.InitAgent, p.TrainMicroBatch, p.OptimStep, p.PublishWeights, p.SaveCheckpoint,
                  p.OffloadAgent, p.LoadAgent, p.ReleaseState}
    assert set(TrainerHandler.COMMANDS) == to_trainer
    sent = []

    class Session:  # what a handler is handed to reply through
        async def send(self, msg, buffers):
            sent.append(msg)

    h = TrainerHandler()
    h.session = Session()
    asyncio.run(h.handle(p.OptimStep(1, "planner", 1, samples=0), []))
    asyncio.run(h.handle(p.LoadModel(2, "planner", "/m", 0), []))  # a rollout command
    assert h._commands.qsize() == 1
    assert isinstance(sent[0], p.Error) and "cannot handle LoadModel" in sent[0].message
    with pytest.raises(KeyError, match="not resident"):
        h._execute(asyncio.run(h._commands.get()))


def test_a_full_checkpoint_resumes_on_another_trainer_with_weights_and_optimizer_state(model_dir, tmp_path):
    from flexmarl.controller.train.checkpoints import ResumePoint

    h = trained_handler(model_dir)
    h._execute(p.OptimStep(5, "planner", 3, samples=8))  # between steps: nothing accumulated
    before = snapshot(h)
    saved = h._execute(p.SaveCheckpoint(6, "planner", str(tmp_path / "step" / "planner"), full_state=True))
    assert saved.version == 3 and saved.nbytes > 0 and saved.state is not None
    h.close()  # the checkpoint outlives the trainer that wrote it
    (tmp_path / "step").rename(tmp_path / "moved")  # and is found where it is now, not where it was written
    handle = ResumePoint(tmp_path / "moved", 3, {}).training_state("planner")
    other = TrainerHandler()
    other._execute(p.LoadAgent(7, "planner", str(model_dir), 1e-3, 1.0, 3, 0, handle))
    after = snapshot(other)
    assert before.keys() == after.keys() and any(k.startswith("optim/") for k in after)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert other.agents["planner"].version == 3
    # The same directory holds Hugging Face weights that transformers loads as they are.
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "moved" / "planner")
    assert all(torch.equal(a, before[f"param/{k}"]) for k, a in hf.named_parameters())
    other.close()


def test_a_checkpoints_training_state_is_checked_against_its_manifest_before_it_is_loaded(model_dir, tmp_path):
    from flexmarl.runtime.checksums import DamagedFile, sha256_file

    h = trained_handler(model_dir)
    h._execute(p.OptimStep(5, "planner", 3, samples=8))
    saved = h._execute(p.SaveCheckpoint(6, "planner", str(tmp_path / "planner"), full_state=True))
    h.close()
    state_file = tmp_path / "planner" / p.TRAINING_STATE_FILE
    digest = sha256_file(state_file)
    with open(state_file, "r+b") as fh:  # one byte of the optimizer state flipped on disk
        fh.seek(state_file.stat().st_size - 100)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x01]))
    other = TrainerHandler()
    handle = msgspec.structs.replace(saved.state, path=str(state_file))  # where it is now (it was staged)
    load = p.LoadAgent(7, "planner", str(model_dir), 1e-3, 1.0, 3, 0, handle, checksum=digest)
    with pytest.raises(DamagedFile, match=f"{state_file} does not match its checksum in the checkpoint's manifest"):
        other._execute(load)
    assert "planner" not in other.agents  # nothing was loaded
    other.close()


def test_a_full_checkpoint_is_refused_while_gradients_are_pending(model_dir, tmp_path):
    h = trained_handler(model_dir)  # leaves a micro-batch accumulated
    with pytest.raises(ValueError, match="between steps"):
        h._execute(p.SaveCheckpoint(5, "planner", str(tmp_path / "planner"), full_state=True))
    assert not (tmp_path / "planner").exists()
    h.close()


def test_a_checkpoint_on_a_full_disk_fails_clearly_and_leaves_nothing(model_dir, tmp_path):
    import subprocess

    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        h = trained_handler(model_dir)
        h._execute(p.OptimStep(5, "planner", 3, samples=8))
        with pytest.raises(OSError, match="cannot write the checkpoint of planner.*No space left"):
            h._execute(p.SaveCheckpoint(6, "planner", str(disk / "planner"), full_state=True))
        assert list(disk.iterdir()) == []  # no half-written directory, no staging left behind
        h.close()
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_an_nccl_publish_hands_the_channel_the_controllers_group_and_its_receiver_count(model_dir):
    from flexmarl.runtime.params.channel import ParamChannel, ParamChannelConfig

    class RecordingChannel(ParamChannel):
        """The real channel, over tcp (no GPU here), recording what nccl would have been given."""

        def __init__(self, config):
            super().__init__(config)
            self.asked = []

        def publish(self, tensors, **kw):
            self.asked.append(kw)
            return super().publish(tensors, **{**kw, "transport": "tcp", "group": ""})

    config = ParamChannelConfig(tcp_chunk_bytes=1 << 16)
    h = TrainerHandler(config)
    h._execute(p.InitAgent(1, "planner", str(model_dir), 1e-3, 0))
    assert h.channel().config is config  # the worker's settings, not the defaults
    h._channel = RecordingChannel(config)
    h._execute(p.PublishWeights(2, "planner", 0, "nccl", ["r3", "r5"], "planner/ab-1"))
    (asked,) = h._channel.asked
    assert (asked["transport"], asked["receivers"], asked["group"]) == ("nccl", 2, "planner/ab-1")
    h.close()


def test_a_step_or_publish_passes_other_agents_queued_micro_batches_but_never_its_own():
    import asyncio

    from flexmarl.workers.trainer.worker import CommandQueue

    def mb(agent):
        return micro_batch(0, agent, 1, [], 0, 2.0, p.LossOptions())

    queue = CommandQueue()
    sent = [mb("a"), mb("b"), p.OptimStep(0, "c", 1, samples=0), p.OptimStep(0, "a", 1, samples=0),
            p.PublishWeights(0, "c", 1, "shm")]
    for msg in sent:
        queue.put(msg)

    async def drain():
        return [await queue.get() for _ in sent]

    got = asyncio.run(drain())
    # c's step and publish go first; a's step waits for a's micro-batch, then passes b's.
    assert [(type(m).__name__, m.agent) for m in got] == [
        ("OptimStep", "c"), ("PublishWeights", "c"), ("TrainMicroBatch", "a"), ("OptimStep", "a"),
        ("TrainMicroBatch", "b")]
    assert queue.qsize() == 0


def test_a_step_with_an_injected_inf_gradient_is_skipped_and_the_weights_stay_finite(model_dir):
    h = trained_handler(model_dir, steps=1)  # an optimizer state to keep, gradients of step 2 pending
    state = h.agents["planner"]
    before = {k: v for k, v in snapshot(h).items() if not k.startswith("grad/")}  # weights, optimizer state
    next(state.model.parameters()).grad.view(-1)[0] = float("inf")  # one overflow
    done = h._execute(p.OptimStep(5, "planner", 2, samples=8))
    assert done.stats.skipped and done.version == state.version == 2
    after = snapshot(h)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert not any(q.grad is not None and q.grad.any() for q in state.model.parameters())  # the bad gradient is gone
    # the next step starts clean and trains as usual
    h._execute(micro_batch(6, "planner", 3, [sample(i, random.Random(9), 2) for i in range(8)]))
    done = h._execute(p.OptimStep(7, "planner", 3, samples=8))
    assert not done.stats.skipped
    assert all(torch.isfinite(q).all() for q in state.model.parameters())
    assert any(not torch.equal(q, before[k]) for k, q in snapshot(h).items() if k in before)
    h.close()


def test_a_received_state_puts_gradients_and_optimizer_state_beside_their_parameters():
    """An adapter agent's parameters already live on the GPU (on its shared base) when its
    parked state comes back: gradients and Adam's moments must be made there, its step
    counter on the CPU. A meta-device model stands in for a GPU one here."""
    import types

    from flexmarl.runtime.params.types import TensorSpec
    from flexmarl.workers.trainer.worker import receive_training_state

    model = torch.nn.Linear(2, 3, bias=False, device="meta")
    optimizer = torch.optim.Adam(model.parameters())
    layout = [TensorSpec("param/weight", "float32", (3, 2), 0, 24), TensorSpec("grad/weight", "float32", (3, 2), 64, 24),
              TensorSpec("optim/weight/exp_avg", "float32", (3, 2), 128, 24),
              TensorSpec("optim/weight/step", "float32", (), 192, 4)]
    received = []
    channel = types.SimpleNamespace(receive_into=lambda handle, dst, atomic: received.append(dst))
    receive_training_state(channel, types.SimpleNamespace(layout=layout, agent="a"), model, optimizer)
    (dst,) = received
    weight = model.weight
    assert weight.grad.device == weight.device and dst["optim/weight/exp_avg"].device == weight.device
    assert dst["optim/weight/step"].device == torch.device("cpu")


def test_decoupled_ppo_keeps_the_previous_versions_weights_and_they_stay_through_a_swap_here(model_dir):
    """From the first decoupled micro-batch on, each step keeps the weights it changes:
    batch v + 1 is scored under version v - 1's weights as its proximal policy, also after
    the agent was parked and taken back on this trainer."""
    h = fresh_handler(model_dir)
    rng = random.Random(5)
    decoupled = p.LossOptions(off_policy="decoupled")
    initial = {k: v.detach().clone() for k, v in h.agents["planner"].model.named_parameters()}
    h._execute(micro_batch(2, "planner", 1, [sample(i, rng, 0) for i in range(4)], max_staleness=1, loss=decoupled))
    assert h.agents["planner"].keeps_previous and h.agents["planner"].previous.tensors is None  # version 0: none yet
    h._execute(p.OptimStep(3, "planner", 1, samples=4))
    state = h.agents["planner"]
    kept = state.previous.tensors
    assert all(torch.equal(kept[k], initial[k]) for k in initial)
    assert any(not torch.equal(p_.detach(), initial[k]) for k, p_ in state.model.named_parameters())
    out = h._execute(p.OffloadAgent(4, "planner"))
    h._execute(p.LoadAgent(5, "planner", str(model_dir), 1e-3, 1.0, out.version, out.accumulated, out.handle))
    state = h.agents["planner"]
    assert all(torch.equal(state.previous.tensors[k], initial[k]) for k in initial)
    version1 = {k: v.detach().clone() for k, v in state.model.named_parameters()}
    h._execute(micro_batch(6, "planner", 2, [sample(i, rng, 1) for i in range(4)], max_staleness=1, loss=decoupled))
    assert all(torch.equal(v.detach(), version1[k]) for k, v in state.model.named_parameters())  # put back
    h._execute(p.OptimStep(7, "planner", 2, samples=4))
    assert all(torch.equal(state.previous.tensors[k], version1[k]) for k in version1)
    h.close()


def test_only_a_decoupled_off_policy_agent_keeps_a_previous_version(model_dir):
    h = fresh_handler(model_dir)
    rng = random.Random(6)
    for loss, staleness in ((p.LossOptions(off_policy="decoupled"), 0), (p.LossOptions(off_policy="ppo_clip"), 1)):
        h._execute(micro_batch(2, "planner", h.agents["planner"].version + 1,
                               [sample(i, rng, 0) for i in range(2)], max_staleness=staleness, loss=loss))
        h._execute(p.OptimStep(3, "planner", h.agents["planner"].version + 1, samples=2))
    assert h.agents["planner"].previous.tensors is None
    h.close()
