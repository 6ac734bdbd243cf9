import msgspec
import numpy as np
import pytest

from flexmarl.runtime import protocol as p
from flexmarl.runtime.keys import SCORE_TURN, GroupKey
from flexmarl.runtime.params.types import Location, ParamHandle, TensorSpec

HANDLE = ParamHandle(transport="shm", agent="solver", version=1, key="solver-v1-42-abc", total_bytes=128,
                     layout=[TensorSpec("w", "bfloat16", (2, 3), 0, 12), TensorSpec("b", "float32", (), 64, 4)],
                     checksum=2**64 - 1, publisher=Location("host", 42), path="/dev/shm/flexmarl-param-42-abc")

G1, G2 = GroupKey("s1q0", "solver", "00ab12cd-0"), GroupKey("s1q0", "solver", "00ab12cd-b0-1")
# Two members, three output ids; member 1 took a second turn from its output id 1 on.
GROUP = p.TrainGroup(G1, p.packed("i", [1]), [1, 2], p.packed("i", [2, 3, 4]), p.packed("f", [-0.3, -0.1, -0.2]),
                     [0.5, -0.5], [0, 0], 0.7, loss_mask=bytes([1, 0, 1]), turns=[p.MemberTurn(1, 1, 0.5)])

EXAMPLES = [
    p.Hello(p.PROTOCOL_VERSION, "w1", "rollout", "host", 123, ["cpu"], {"slots": 4.0}),
    p.Welcome(p.PROTOCOL_VERSION, 1.0, 5.0),
    p.Reject("duplicate"),
    p.Heartbeat(7, {"queued": 3.0}),
    p.Shutdown("done"),
    p.Bye("bye"),
    p.Error(9, "boom", recoverable=False),
    p.Echo(1, b"abc"),
    p.EchoReply(1, b"abc"),
    p.EchoReply(2, b"", {"busy_s": 1.5, "queued_commands": 0.0}),
    p.LoadModel(2, "planner", "/tmp/m", 0, seed=3),
    p.ModelLoaded(2, "planner", 0, 1.5),
    p.Generate(3, [p.GenGroup(G1, "solver", 8, [1, 2, 3], 6, 1.0, 42),
                   p.GenGroup(G2, "solver", 4, [1, 2], 6, 1.0, 50, first=4, version=2),
                   p.GenGroup(G2, "solver", 1, [1, 2, 7], 6, 1.0, 77, first=1, turn=2)]),  # member 1's third turn
    p.Generated(3, [p.GroupResult(G1, 0, 0, [2, 1], p.packed("i", [4, 5, 6]), p.packed("f", [-0.5, -0.25, -1.0]),
                                  ["length", "stop"], 16)], True, {"queued": 0.0},
                [p.GroupRefused(G2, 1, "too long", turn=2), p.GroupRefused(G2, 3, "aborted", aborted=True)]),
    p.LoadWeights(4, "solver", 1, HANDLE),
    p.LoadWeights(4, "solver", 1, HANDLE, rank=2),  # nccl: the instance's rank in the agent's group
    p.WeightsLoaded(4, "solver", 1, 0.01),
    p.CancelLoad(5, "solver", "solver-v1-123-ab12"),  # another rank of its NCCL broadcast died
    p.LoadCancelled(5, "solver"),
    p.LoadAdapter(6, "critic", 20, "/runs/r/checkpoints/step-000020/critic", p.LoraSettings(8, 16.0, 0.0, ("q_proj",)),
                  {"adapter_model.safetensors": "ab" * 32}),
    p.InitAgent(5, "checker", "/tmp/c", 1e-3, 0),
    p.AgentReady(5, "checker", 0, 1000),
    p.TrainMicroBatch(6, "checker", 1, [GROUP]),
    p.MicroBatchDone(6, "checker", 0.1, 10, 0.2),
    p.OptimStep(7, "checker", 1, samples=64),
    p.StepDone(7, "checker", 1, 0.9, 0.01),
    p.PublishWeights(8, "checker", 1, "shm", ["r1"]),
    p.PublishWeights(8, "checker", 1, "nccl", ["r1", "r4"], "checker/ab12cd-3"),
    p.WeightsPublished(8, "checker", 1, HANDLE, 100, 0.1),
    p.SaveCheckpoint(9, "checker", "/tmp/ck"),
    p.CheckpointSaved(9, "checker", "/tmp/ck", 1),
    p.OffloadAgent(10, "solver", "shm"),
    p.AgentOffloaded(10, "solver", 3, 0, HANDLE, 1000, 0.01),
    p.LoadAgent(11, "solver", "/tmp/m", 1e-3, 1.0, 3, 0, HANDLE),
    p.ReleaseState(12, "solver", HANDLE),
    p.StateReleased(12, "solver"),
    # device and precision settings, a trainer group's shards, pinned GPUs
    p.Hello(p.PROTOCOL_VERSION, "t1", "trainer", "host", 124, ["cuda:0", "cuda:1"], {}, ["2", "3"]),
    p.LoadModel(13, "planner", "/tmp/m", 0, 1, 0, p.EngineSettings("bfloat16", 0.5, 2)),
    p.InitAgent(14, "checker", "/tmp/c", 1e-3, 0, 1.0, p.TrainerSettings("bfloat16", "pure", True)),
    p.AgentOffloaded(15, "solver", 3, 0, HANDLE, 1000, 0.01, [HANDLE, HANDLE]),
    p.LoadAgent(16, "solver", "/tmp/m", 1e-3, 1.0, 3, 0, HANDLE, p.TrainerSettings(), [HANDLE]),
    p.ReleaseState(17, "solver", HANDLE, [HANDLE]),
    # environment workers
    p.Hello(p.PROTOCOL_VERSION, "env-0", "env", "host", 125, ["cpu"]),
    p.EnvSetup(18, "/jobs/flow.py:episode", processes=4, max_sessions=8, memory_mb=512),
    p.EnvReady(18, 4, 0.8, "drop the network"),
    p.EnvCalls(19, [p.EnvCall(1, "flexmarl_workflow_flow_ab12cd34", "score", b"\x92\x91\xa1x\x80", 5.0,
                              episode="s1q0"),
                    p.EnvCall(2, "tasks", "Maze", b"\x92\x90\x80", 5.0, op="open", session="s1q0#1"),
                    p.EnvCall(3, "", "step", b"\x92\x91\x01\x80", 5.0, session="s1q0#1")]),
    p.EnvResults(19, [p.EnvResult(1, b"\xcb?\xf0\x00\x00\x00\x00\x00\x00", seconds=0.01),
                      p.EnvResult(2, failure="raised", error="ValueError: bad (at flow.py:3 in Maze)",
                                  detail="Traceback (your code): ...")], False, {"running": 1.0}),
    p.EnvCancel(20, [3]),
    p.AbortGroups(21, [G2], [1], [2]),
]


def test_a_settings_value_outside_its_options_is_a_bad_body():
    (frame,) = p.encode(p.LoadModel(1, "a", "/m", 0))
    bad = bytes(frame).replace(b"auto", b"fp8!")
    with pytest.raises(p.ProtocolError, match="bad LOAD_MODEL body"):
        p.decode([bad])


def test_examples_cover_every_message_kind():
    assert {int(m.KIND) for m in EXAMPLES} == {int(k) for k in p.Kind}


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_kind_round_trips(msg):
    buf = np.arange(10, dtype=np.float32)
    frames = p.encode(msg, [buf])
    assert len(frames) == 2 and frames[0][0] == int(msg.KIND)  # kind and body in one frame, then the buffer
    decoded, buffers = p.decode(frames)
    assert decoded == msg
    assert np.frombuffer(buffers[0], dtype=np.float32).tolist() == buf.tolist()


def test_unknown_kind_is_a_protocol_error():
    with pytest.raises(p.ProtocolError, match="unknown message kind 200"):
        p.decode([bytes([200]) + b"\x90"])


def test_body_that_does_not_match_its_kind_is_a_protocol_error():
    wrong = msgspec.msgpack.encode(p.Shutdown("x"))
    with pytest.raises(p.ProtocolError, match="bad HELLO body"):
        p.decode([bytes([p.Kind.HELLO]) + wrong])


def test_a_message_without_buffers_is_one_frame():
    msg = p.Echo(7, b"ping")
    frames = p.encode(msg)
    assert len(frames) == 1 and bytes(frames[0]) == bytes([p.Kind.ECHO]) + msgspec.msgpack.encode(msg)
    assert p.decode(frames) == (msg, [])
    assert p.decode([bytes(frames[0])]) == (msg, [])  # as received: bytes, not the bytearray sent


def test_garbage_and_missing_frames_are_protocol_errors():
    with pytest.raises(p.ProtocolError, match="at least 1 frame") as caught:
        p.decode([])
    assert caught.value.reason == "too few frames"
    for first in (b"", b"\x01"):
        with pytest.raises(p.ProtocolError, match="kind byte and a body") as caught:
            p.decode([first])
        assert caught.value.reason == "bad kind frame"
    # Kind and body in two frames (the format before): the kind alone is refused as such.
    with pytest.raises(p.ProtocolError, match="kind byte and a body"):
        p.decode([bytes([p.Kind.ECHO]), msgspec.msgpack.encode(p.Echo(1))])
    with pytest.raises(p.ProtocolError, match="bad HEARTBEAT body"):
        p.decode([bytes([p.Kind.HEARTBEAT]) + b"\xc1\xff\x00garbage"])


def test_a_string_that_is_not_utf8_is_a_protocol_error():
    with pytest.raises(p.ProtocolError, match="bad BYE body") as caught:
        p.decode([bytes([p.Kind.BYE]) + b"\x91\xa1\xff"])  # ["\xff"]
    assert caught.value.reason == "bad body"


def test_peer_text_in_an_error_is_cut_short():
    with pytest.raises(p.ProtocolError) as caught:
        p.decode([bytes([p.Kind.HELLO]) + msgspec.msgpack.encode(["x" * 100_000])])
    assert len(str(caught.value)) < 400


def test_no_pickle_on_the_wire():
    import pickle
    with pytest.raises(p.ProtocolError):
        p.decode([bytes([p.Kind.ECHO]) + pickle.dumps({"x": 1})])


def test_an_optimizer_step_that_does_not_say_how_many_samples_it_covers_is_refused():
    frames = [bytes([p.Kind.OPTIM_STEP]) + msgspec.msgpack.encode([7, "checker", 1])]
    with pytest.raises(p.ProtocolError, match="bad OPTIM_STEP body"):
        p.decode(frames)
    frames = [bytes([p.Kind.OPTIM_STEP]) + msgspec.msgpack.encode([7, "checker", 1, 64])]
    assert p.decode(frames)[0] == p.OptimStep(7, "checker", 1, samples=64)


def test_loss_options_sample_temperatures_and_step_stats_round_trip():
    batch = p.TrainMicroBatch(6, "checker", 1, [GROUP], 1, 1.2,
                              p.LossOptions("token_mean", 8.0, "ppo_clip", 0.1))
    step = p.OptimStep(7, "checker", 1, samples=64)
    done = p.StepDone(7, "checker", 1, 0.9, 0.01, p.StepStats(0.1, 0.9, 2.3, 5.5, 8, 0.01, 0.001, 0.2, 0.0, 64, 352))
    for msg in (batch, step, done):
        assert p.decode(p.encode(msg))[0] == msg
    bad = p.encode(p.TrainMicroBatch(6, "checker", 1, [], loss=p.LossOptions(agg="mean")))
    with pytest.raises(p.ProtocolError, match="bad TRAIN_MICROBATCH body"):
        p.decode(bad)


HANDLE_CARRIERS = [m for m in EXAMPLES if "handle" in m.__struct_fields__]


def test_the_agents_menus_fields_round_trip():
    """A frozen adapter's directory instead of a handle, a scoring group, a teacher's
    logprobs per output id, the teacher's KL in a step's stats."""
    msgs = [p.LoadWeights(3, "judge", 0, None, lora=p.LoraSettings(rank=8), adapter_dir="/runs/x/final/judge"),
            p.Generate(4, [p.GenGroup(G1, "t", 1, [1, 2, 3], 1, 1.0, 0, 1, turn=SCORE_TURN, score_from=2)]),
            p.TrainMicroBatch(5, "s", 1, [p.TrainGroup(G1, p.packed("i", [1]), [2], p.packed("i", [2, 3]),
                                                       p.packed("f", [-0.3, -0.1]), [0.5], [0],
                                                       teacher_logprobs=p.packed("f", [-0.2, -0.4]))],
                              loss=p.LossOptions(off_policy="decoupled", behav_weight_cap=3.0, teacher_coef=0.5)),
            p.StepDone(6, "s", 1, 0.9, 0.01, p.StepStats(teacher_kl=0.25))]
    for msg in msgs:
        assert p.decode(p.encode(msg))[0] == msg


@pytest.mark.parametrize("msg", HANDLE_CARRIERS, ids=lambda m: type(m).__name__)
def test_a_message_carrying_a_handle_decodes_it_as_a_typed_param_handle(msg):
    decoded, _ = p.decode(p.encode(msg))
    assert type(decoded.handle) is ParamHandle and decoded.handle == HANDLE
    assert decoded.handle.layout[0].shape == (2, 3) and decoded.handle.publisher.pid == 42


def test_every_message_that_names_a_parameter_handle_carries_it_typed():
    assert {type(m).__name__ for m in HANDLE_CARRIERS} == {
        "LoadWeights", "WeightsPublished", "AgentOffloaded", "LoadAgent", "ReleaseState"}
    # LoadWeights may carry none: a frozen adapter agent's weights come from a directory
    assert all(cls.__annotations__.get("handle") in (ParamHandle, "ParamHandle", "ParamHandle | None")
               for cls in map(type, HANDLE_CARRIERS))


def test_a_malformed_handle_is_a_protocol_error_not_a_half_filled_message():
    body = msgspec.msgpack.encode([4, "solver", 1, {"transport": "shm", "agent": "solver"}])
    with pytest.raises(p.ProtocolError, match="bad LOAD_WEIGHTS body"):
        p.decode([bytes([p.Kind.LOAD_WEIGHTS]) + body])


def test_the_protocol_and_its_handles_import_without_torch():
    """The controller imports the protocol; handles inside it must not pull torch in."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "from flexmarl.runtime import protocol\n"
            "from flexmarl.runtime.params import types as param_types\n"
            "assert protocol.LoadAgent.__annotations__['handle'] in ('ParamHandle', param_types.ParamHandle)\n"
            "assert protocol.LoadWeights.__annotations__['handle'] == 'ParamHandle | None'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_teachers_top_k_round_trips_in_the_scoring_request_its_reply_and_the_training_message():
    msgs = [p.Generate(4, [p.GenGroup(G1, "t", 1, [1, 2, 3], 1, 1.0, 0, 1, turn=SCORE_TURN, score_from=2,
                                      score_top_k=2)]),
            p.Generated(4, [p.GroupResult(G1, 1, 0, [1], p.packed("i", [3]), p.packed("f", [-0.5]), ["score"],
                                          turn=SCORE_TURN, top_ids=p.packed("i", [3, 1]),
                                          top_logprobs=p.packed("f", [-0.5, -1.2]))], True),
            p.TrainMicroBatch(5, "s", 1, [p.TrainGroup(G1, p.packed("i", [1]), [1], p.packed("i", [3]),
                                                       p.packed("f", [-0.3]), [0.5], [0],
                                                       teacher_logprobs=p.packed("f", [-0.5]),
                                                       teacher_top_ids=p.packed("i", [3, 1]),
                                                       teacher_top_logprobs=p.packed("f", [-0.5, -1.2]))],
                              loss=p.LossOptions(teacher_coef=1.0, teacher_top_k=2)),
            p.StepDone(6, "s", 1, 0.9, 0.01, p.StepStats(teacher_kl=0.25, teacher_top_kl=0.1))]
    for msg in msgs:
        assert p.decode(p.encode(msg))[0] == msg
