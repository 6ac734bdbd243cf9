"""The local launcher's pinning, with a stand-in for the process it would start."""

from flexmarl.controller import launcher
from flexmarl.controller.launcher import LocalWorkers


class FakePopen:
    started = []

    def __init__(self, cmd, env, **kwargs):
        self.cmd, self.env, self.pid = cmd, env, 4242
        FakePopen.started.append(self)

    def poll(self):
        return 0


def test_each_started_worker_is_pinned_to_its_own_gpus(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")  # what the launcher itself sees
    FakePopen.started.clear()
    workers = LocalWorkers("tcp://127.0.0.1:1")
    workers.start("rollout", "rollout-0", [1])
    workers.start("trainer", "trainer-0", [2, 3])
    workers.start("rollout", "rollout-1")  # no list: left as the environment has it
    envs = [proc.env for proc in FakePopen.started]
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "1" and envs[1]["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert envs[0]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # numbers as nvidia-smi shows them
    assert envs[2]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_a_trainer_is_started_as_rank_0_of_a_group_of_the_configured_size(monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    FakePopen.started.clear()
    workers = LocalWorkers("tcp://127.0.0.1:1", trainer_group_size=2)
    workers.start("trainer", "trainer-0", [2, 3])
    workers.start("rollout", "rollout-0", [0])
    trainer, rollout = (proc.cmd for proc in FakePopen.started)
    assert trainer[trainer.index("--group-size") + 1] == "2" and "--group-size" not in rollout
