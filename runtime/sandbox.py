"""A sandbox for code a model wrote: one Python program run in a process of its own, under limits.

    from flexmarl.runtime.sandbox import Limits, run_python

    result = run_python("print(sum(range(10)))", limits=Limits(wall_s=2))
    result.exit_status, result.stdout, result.stderr, result.limit   # 0, "45\\n", "", ""
    result.check()                                                   # raises SandboxError unless it ran clean

A tool or reward function calls it (on an environment worker, or in the controller's tool
pool where there is none). The program gets:

- limits the kernel enforces, set with `resource.setrlimit` in the child before the code
  runs: CPU seconds, address space, the size of any file it writes, open files, and
  processes (this user's count when it starts plus `Limits.processes`);
- a wall-clock limit this side enforces: past it the child's whole process group is killed;
- a fresh temporary directory: its working directory, HOME and TMPDIR; removed after;
- an environment of its own (PATH, HOME, TMPDIR, LANG: none of the run's keys or settings),
  and Python in isolated mode without site-packages or bytecode files (`-I -S -B`);
- no network, where the kernel lets this process make a network namespace (as root, or in a
  user namespace of its own): it sees only a loopback of its own, down; a process-ID
  namespace with it, so nothing the program forks outlives it;
- when started as root, the program runs as `nobody`: the run's files are not its to write;
- an audit hook in its interpreter that refuses writing outside its directory, starting
  other programs, loading native code (ctypes) and, where no network namespace could be
  made, opening sockets.

`capabilities()` finds out once per process what this host allows (a probe child); the
first `run_python` logs once what it cannot do. `run_python` returns a `SandboxResult`: the
exit status (negative: the signal that ended it), stdout and stderr (each cut at
`Limits.output_bytes`), which limit was hit (`limit`: "", "cpu", "wall", "memory",
"file_size", "processes" or "output") and the seconds it took.

Why it is written here on the standard library: the sandboxes one could reuse need
privileges (nsjail, firejail, bubblewrap installed setuid, a container runtime) or a kernel
runtime that is not on every host (gVisor); the sandbox of a tool or reward has to work
wherever an environment worker runs, unprivileged included, with nothing to install. It
guards against what model-written code gets wrong (endless loops, runaway allocations,
fork storms, stray writes, network calls); it is not a boundary against a determined
attacker: for that, run the environment workers in containers or VMs of their own.

It knows nothing about workers, the controller or what the program is for.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("flexmarl.sandbox")

NOBODY = 65534  # the uid and gid a root-started sandbox runs as
SETUP_FAILED = 125  # the child's exit status when it could not put itself in the sandbox
# Linux's clone flags (os.unshare is Python 3.12's): a user, network and process-ID namespace.
CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000
LIMITS = ("cpu", "wall", "memory", "file_size", "processes", "output")


class SandboxError(RuntimeError):
    """A sandboxed program did not run clean: it exited non-zero, was killed, or hit a limit."""


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    cpu_s: float = 2.0  # CPU seconds (rounded up to whole seconds: the kernel counts those)
    wall_s: float = 5.0  # wall-clock seconds, start to end
    memory_mb: int = 256  # address space of each of its processes
    file_mb: float = 1.0  # the largest file it may write
    processes: int = 8  # processes it may start, itself included
    open_files: int = 64
    output_bytes: int = 64 * 1024  # of stdout and of stderr each; the rest is dropped


@dataclass(frozen=True)
class SandboxResult:
    exit_status: int  # 0: success; negative: killed by that signal
    stdout: str
    stderr: str
    limit: str = ""  # the limit it hit: "", or one of LIMITS
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_status == 0 and not self.limit

    def check(self) -> "SandboxResult":
        """Itself, if the program ran clean; SandboxError in one line otherwise."""
        if self.ok:
            return self
        if self.limit:
            raise SandboxError(f"the sandboxed program hit its {self.limit} limit (exit status {self.exit_status})")
        last = next((line for line in reversed(self.stderr.splitlines()) if line.strip()), "")
        raise SandboxError(f"the sandboxed program exited with status {self.exit_status}"
                           + (f": {last.strip()[:300]}" if last else ""))


@dataclass(frozen=True)
class Capabilities:
    """What the kernel lets this process do for a sandbox (see `capabilities`)."""

    namespaces: int = 0  # the clone flags that worked: network and process-ID namespaces
    as_nobody: bool = False  # started as root: the program runs as nobody
    missing: str = ""  # what it cannot do here, in words ("" everything)

    @property
    def network_dropped(self) -> bool:
        return bool(self.namespaces & CLONE_NEWNET)


# The program that puts itself in the sandbox and then runs the code; `python -I -S -B -c`
# runs it with its settings as JSON in argv[1]. It writes JSON lines to the status pipe:
# what it could set up (a probe), and the exception that ended the code, if any.
BOOTSTRAP = r'''
import json, os, resource, signal, sys
s = json.loads(sys.argv[1])
status = os.fdopen(s["status_fd"], "w", buffering=1)
def say(**kw):
    kw["pid"] = os.getpid()
    try:
        status.write(json.dumps(kw) + "\n")
    except OSError:
        pass
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def unshare(flags):
    return libc.unshare(ctypes.c_int(flags)) == 0
flags = 0
for f in s["try_flags"]:
    if unshare(f):
        flags = f
        break
if s["need_flags"] and flags != s["need_flags"]:
    say(setup="could not make namespaces: errno %d" % ctypes.get_errno())
    os._exit(125)
if flags & s["newpid"]:
    child = os.fork()  # the first child of a new PID namespace is its init: when it ends, all do
    if child:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _, code = os.waitpid(child, 0)
        say(child_status=code)
        os._exit(os.waitstatus_to_exitcode(code) % 256 if os.WIFEXITED(code) else 128 + os.WTERMSIG(code))
def limit(which, n):
    resource.setrlimit(which, (n, n))
limit(resource.RLIMIT_CORE, 0)
limit(resource.RLIMIT_NOFILE, s["open_files"])
limit(resource.RLIMIT_FSIZE, s["file_bytes"])
resource.setrlimit(resource.RLIMIT_CPU, (s["cpu_s"], s["cpu_s"] + 1))
if s["as_nobody"] and os.getuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, after the uid change (which clears it)
if os.getppid() == 1 and not (flags & s["newpid"]):
    os._exit(125)  # the caller is gone already
uid = os.getuid()
mine = 0
for entry in os.listdir("/proc"):
    if entry.isdigit():
        try:
            with open("/proc/%s/status" % entry) as fh:
                mine += any(line.startswith("Uid:") and line.split()[1] == str(uid) for line in fh)
        except OSError:
            pass
limit(resource.RLIMIT_NPROC, mine + s["processes"])
if s["probe"]:
    os.listdir(os.path.dirname(os.__file__))  # the standard library is still readable
    say(flags=flags, uid=os.getuid())
    os._exit(0)
limit(resource.RLIMIT_AS, s["memory_bytes"])
home = os.path.realpath(os.getcwd())
code = open("main.py").read()
guard_sockets = not flags & s["newnet"]
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATHS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2,
         "os.chmod": 1, "os.chown": 1, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1, "shutil.copyfile": 2}
def inside(path):
    if isinstance(path, int):
        return True
    p = os.path.realpath(os.fsdecode(path))
    return p == home or p.startswith(home + "/") or p == "/dev/null"
def refuse(what):
    raise PermissionError("the sandbox refuses " + what)
def hook(event, args):
    if event == "open":
        path, mode, oflags = args
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (oflags or 0) & WRITE
        if writing and not inside(path):
            refuse("writing outside its directory: %r" % (path,))
    elif event in PATHS:
        for path in args[:PATHS[event]]:
            if path is not None and not inside(path):
                refuse("%s outside its directory: %r" % (event, path))
    elif event in ("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile"):
        refuse("starting other programs (%s)" % event)
    elif event == "import" and args[0] in ("ctypes", "_ctypes"):
        refuse("loading native code (ctypes)")
    elif event.startswith("ctypes.") or (guard_sockets and event == "socket.__new__"):
        refuse("this (%s)" % event)
forks = os.open(".forks", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
os.unlink(".forks")  # counted by its size, which every process of the program appends to
def counted_fork():
    os.write(forks, b"x")
    if os.fstat(forks).st_size >= s["processes"]:
        raise BlockingIOError(11, "the sandbox refuses more processes (its limit is %d)" % s["processes"])
main = os.getpid()
sys.addaudithook(lambda event, args: counted_fork() if event == "os.fork" else hook(event, args))
del libc, ctypes
for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
    del sys.modules[name]  # imported again, it is refused
sys.argv = ["main.py"]
try:
    exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as exc:
    if os.getpid() == main:
        say(exception=type(exc).__name__, errno=getattr(exc, "errno", None) or 0)
    raise
'''

_caps: Capabilities | None = None
_caps_lock = threading.Lock()
_told = False


def capabilities() -> Capabilities:
    """What this host lets a sandbox do, found once per process by a probe child."""
    global _caps
    with _caps_lock:
        if _caps is None:
            _caps = _probe()
        return _caps


def _flag_choices() -> list[int]:
    """The namespaces to try, best first: root may make them directly, others in a user
    namespace of their own."""
    both = CLONE_NEWNET | CLONE_NEWPID
    return [both, CLONE_NEWNET] if os.geteuid() == 0 else [CLONE_NEWUSER | both, CLONE_NEWUSER | CLONE_NEWNET]


def _probe() -> Capabilities:
    """Root tries to run the program as nobody first (nobody must be able to read this
    Python's standard library); the namespaces that work are kept."""
    said: dict | None = None
    for as_nobody in ([True, False] if os.geteuid() == 0 else [False]):
        try:
            status, lines, *_ = _run(None, Limits(wall_s=10.0), _flag_choices(), 0, as_nobody, probe=True)
        except OSError as exc:
            return Capabilities(0, False, f"start a sandbox process at all ({exc})")
        said = next((line for line in lines if "flags" in line), None)
        if status == 0 and said is not None:
            break
    if said is None:
        return Capabilities(0, False, "set itself up (its probe failed)")
    flags = int(said["flags"])
    missing = []
    if not flags & CLONE_NEWNET:
        missing.append("drop the network (no network namespace: the interpreter refuses sockets instead)")
    if not flags & CLONE_NEWPID:
        missing.append("keep forked processes from outliving the program (no process-ID namespace)")
    if not as_nobody:
        missing.append("run the program as another user (writes outside its directory are refused by the "
                       "interpreter only" + (", and root's processes are counted by it, not the kernel" if
                                             os.geteuid() == 0 else "") + ")")
    return Capabilities(flags, as_nobody, "; ".join(missing))


def run_python(code: str, *, stdin: str = "", limits: Limits = Limits(),
               files: dict[str, str] | None = None) -> SandboxResult:
    """Runs `code` as a Python program in the sandbox (see the module docstring), with
    `stdin` as its input and `files` (name -> text) written into its directory first."""
    global _told
    caps = capabilities()
    if caps.missing and not _told:
        _told = True
        log.warning("the sandbox for model-written code cannot %s on this host", caps.missing)
    status, said, out, err, limit, seconds = _run(code, limits, [caps.namespaces] if caps.namespaces else [],
                                                  caps.namespaces, caps.as_nobody, stdin=stdin, files=files or {})
    if not limit:
        limit = _which_limit(status, said, limits, seconds)
    return SandboxResult(status, out, err, limit, seconds)


def _which_limit(status: int, said: list[dict], limits: Limits, cpu_s: float) -> str:
    ended = next((line for line in said if "exception" in line), None)
    if ended is not None:
        if ended["exception"] == "MemoryError":
            return "memory"
        if ended.get("errno") == 27:  # EFBIG: RLIMIT_FSIZE (Python ignores SIGXFSZ)
            return "file_size"
        if ended["exception"] == "BlockingIOError":  # EAGAIN from fork past RLIMIT_NPROC
            return "processes"
    inner = next((line["child_status"] for line in said if "child_status" in line), None)
    signalled = -os.WTERMSIG(inner) if inner is not None and os.WIFSIGNALED(inner) else status
    if signalled in (-signal.SIGXCPU, -signal.SIGKILL) and cpu_s >= math.ceil(limits.cpu_s) - 0.05:
        return "cpu"
    if signalled == -signal.SIGXFSZ:
        return "file_size"
    return ""


def _run(code: str | None, limits: Limits, try_flags: list[int], need_flags: int, as_nobody: bool, *,
         probe: bool = False, stdin: str = "", files: dict[str, str] | None = None
         ) -> tuple[int, list[dict], str, str, str, float]:
    """(exit status, status lines, stdout, stderr, limit hit by this side, CPU seconds)."""
    home = tempfile.mkdtemp(prefix="flexmarl-sandbox-")
    read_status, write_status = os.pipe()
    try:
        for name, text in {**(files or {}), "main.py": code or ""}.items():
            path = os.path.join(home, os.path.basename(name))
            with open(path, "w") as fh:
                fh.write(text)
            if as_nobody:
                os.chown(path, NOBODY, NOBODY)
        if as_nobody:
            os.chown(home, NOBODY, NOBODY)
        settings = {"status_fd": write_status, "try_flags": try_flags, "need_flags": need_flags,
                    "newpid": CLONE_NEWPID, "newnet": CLONE_NEWNET, "as_nobody": as_nobody, "probe": probe,
                    "cpu_s": max(1, math.ceil(limits.cpu_s)), "memory_bytes": limits.memory_mb << 20,
                    "file_bytes": int(limits.file_mb * (1 << 20)), "processes": limits.processes,
                    "open_files": limits.open_files}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", BOOTSTRAP, json.dumps(settings)], cwd=home,
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(write_status,), start_new_session=True)
        os.close(write_status)
        write_status = -1
        try:
            out, err, limit = _exchange(proc, stdin.encode(), limits, started + limits.wall_s)
        finally:
            _kill_group(proc.pid)
        _, code_status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(code_status)
        said = _status_lines(read_status)
        return proc.returncode, said, out, err, limit, usage.ru_utime + usage.ru_stime
    finally:
        if write_status >= 0:
            os.close(write_status)
        os.close(read_status)
        shutil.rmtree(home, ignore_errors=True)


def _exchange(proc: subprocess.Popen, data: bytes, limits: Limits, deadline: float) -> tuple[str, str, str]:
    """Feeds stdin and reads stdout and stderr until the program has ended (what it left
    in the pipes read too; processes it forked may hold them open) or the deadline passes;
    (stdout, stderr, "wall" or "output" or "")."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    chunks: dict[Any, list[bytes]] = {proc.stdout: [], proc.stderr: []}
    sizes: dict[Any, int] = {proc.stdout: 0, proc.stderr: 0}
    limit = ""
    with selectors.DefaultSelector() as sel:
        for stream in (proc.stdout, proc.stderr):
            os.set_blocking(stream.fileno(), False)
            sel.register(stream, selectors.EVENT_READ)
        if data:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        ended = False
        while sel.get_map() and not ended:
            left = deadline - time.monotonic()
            if left <= 0:
                limit = limit or "wall"
                break
            ended = _exited(proc.pid)  # one more pass drains what it wrote before it ended
            for key, _ in sel.select(0 if ended else min(left, 0.05)):
                if key.fileobj is proc.stdin:
                    try:
                        sent = os.write(proc.stdin.fileno(), data)
                    except BrokenPipeError:
                        sent = len(data)
                    except BlockingIOError:
                        continue
                    data = data[sent:]
                    if not data:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                try:
                    block = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not block:
                    sel.unregister(key.fileobj)
                    continue
                room = limits.output_bytes - sizes[key.fileobj]
                if room < len(block):
                    limit = limit or "output"
                chunks[key.fileobj].append(block[:max(room, 0)])
                sizes[key.fileobj] += len(block)
    out = b"".join(chunks[proc.stdout]).decode(errors="replace")
    err = b"".join(chunks[proc.stderr]).decode(errors="replace")
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if not stream.closed:
            stream.close()
    return out, err, limit


def _exited(pid: int) -> bool:
    """Whether the process has ended, without reaping it (wait4 does, for its CPU time)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pid: int) -> None:
    """Whatever is left of the program's process group (its own session) is killed."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _status_lines(fd: int) -> list[dict]:
    os.set_blocking(fd, False)
    data = b""
    try:
        while block := os.read(fd, 65536):
            data += block
    except BlockingIOError:
        pass
    lines = []
    for line in data.decode(errors="replace").splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines
