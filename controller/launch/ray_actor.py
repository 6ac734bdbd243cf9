"""The Ray actor that runs one `flexmarl worker` process on the node Ray placed it on.

Ray only places and watches it: the actor starts the same worker process the local
launcher starts, with its output in a file and its CURVE keys in a private folder on this
node, and answers the launcher (ray_launcher.py): where it runs, the exit code once the
process ends (`wait`), what the process wrote past an offset, and stop. The worker process
watches the actor's process and exits when it is gone (runtime/parent_watch.py), so a
killed actor or a lost node never leaves a worker behind.

It knows nothing of the run: no ZeroMQ, no protocol, no config; it imports Ray only to say
which node it is on, so it can be tested as a plain object. A hung worker is stopped through
it (`signal`), and what an exited one left on the node is removed by it (`reclaim`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from flexmarl.runtime.params.shm_segments import OWNER_ENV, remove_orphan_engine_dirs

OUTPUT_CHUNK = 1 << 20  # the most bytes of output one call returns


class WorkerActor:
    def __init__(self, argv: list[str], env: dict[str, str], keys: dict[str, bytes]) -> None:
        """Starts `python argv...` with `env` over this process's environment (where Ray put
        the GPUs it granted); `keys` (file name -> content) become its --curve-dir."""
        self.home = Path(tempfile.mkdtemp(prefix="flexmarl-worker-"))  # mode 0700
        for name, content in keys.items():
            path = self.home / name
            path.write_bytes(content)
            path.chmod(0o600)
        self.output_path = self.home / "output.log"
        cmd = [sys.executable, *argv, "--parent-pid", str(os.getpid())]
        if keys:
            cmd += ["--curve-dir", str(self.home)]
        with open(self.output_path, "ab") as out:
            # Its shared memory is named as this actor's: once both are gone, the next worker removes it.
            self.proc = subprocess.Popen(cmd, env={**os.environ, **env, OWNER_ENV: str(os.getpid())}, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def where(self) -> dict[str, str | int]:
        """The node, its address and host name, and the worker's PID."""
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "host": socket.gethostname(), "pid": self.proc.pid}

    def wait(self) -> int:
        """Returns the worker's exit code once it exits (negative: the signal that ended it)."""
        return self.proc.wait()

    def output(self, offset: int) -> bytes:
        """What the worker wrote from `offset` on (at most OUTPUT_CHUNK bytes)."""
        with open(self.output_path, "rb") as fh:
            fh.seek(offset)
            return fh.read(OUTPUT_CHUNK)

    def stop(self, timeout: float) -> int:
        """SIGTERM (its orderly exit), SIGKILL after `timeout`; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def signal(self, sig: int) -> None:
        """Sends `sig` to the worker's process, if it is still there."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def reclaim(self) -> int:
        """Removes the directories the exited worker left on this node (a rollout engine's);
        returns how many."""
        return len(remove_orphan_engine_dirs(pids=[self.proc.pid]))

    def finish(self, offset: int) -> bytes:
        """The rest of the output from `offset` (the worker has ended), then the folder with
        its keys and output is removed."""
        with open(self.output_path, "rb") as fh:
            fh.seek(offset)
            rest = fh.read()
        shutil.rmtree(self.home, ignore_errors=True)
        return rest
