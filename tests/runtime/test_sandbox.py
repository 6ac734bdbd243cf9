"""The sandbox for model-written code, with real processes: each limit is hit and named,
the program's world is its own directory and environment, and nothing it starts outlives
it. Where this host cannot drop the network (no namespaces), the interpreter refuses
sockets instead; either way a connection out fails."""

import os
import socket
import threading

import pytest

from flexmarl.runtime import sandbox as sb

QUICK = sb.Limits(cpu_s=2, wall_s=20)  # generous: the limits under test are the ones each test sets


def test_a_clean_program_returns_its_output_and_status_and_reads_its_input():
    result = sb.run_python("import sys\nprint(sys.stdin.read()[::-1])\nprint('note', file=sys.stderr)",
                           stdin="olleh", limits=QUICK)
    assert result.ok and result.exit_status == 0 and result.limit == ""
    assert result.stdout == "hello\n" and result.stderr == "note\n"
    assert result.check() is result


def test_a_failing_program_is_one_line_naming_its_last_error():
    result = sb.run_python("raise ValueError('wrong answer')", limits=QUICK)
    assert result.exit_status == 1 and not result.ok
    with pytest.raises(sb.SandboxError, match="^the sandboxed program exited with status 1: ValueError: wrong answer$"):
        result.check()


def test_its_environment_holds_none_of_the_callers_and_its_directory_is_its_own():
    os.environ["FLEXMARL_TEST_SECRET"] = "hunter2"
    try:
        result = sb.run_python("import os\nprint(sorted(os.environ))\nopen('out.txt', 'w').write('mine')\n"
                               "print(open('out.txt').read(), os.getcwd() == os.environ['HOME'])",
                               files={"given.txt": "x"}, limits=QUICK)
    finally:
        del os.environ["FLEXMARL_TEST_SECRET"]
    assert result.stdout.splitlines() == ["['HOME', 'LANG', 'PATH', 'TMPDIR']", "mine True"]


def test_writing_outside_its_directory_fails_and_leaves_nothing(tmp_path):
    target = tmp_path / "escaped.txt"
    result = sb.run_python(f"open({str(target)!r}, 'w').write('x')", limits=QUICK)
    assert result.exit_status != 0 and "PermissionError" in result.stderr
    assert not target.exists()


def test_a_connection_out_fails_and_reaches_nobody():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    accepted = []

    def accept():
        try:
            accepted.append(listener.accept())
        except OSError:
            pass

    waiter = threading.Thread(target=accept)
    waiter.start()
    port = listener.getsockname()[1]
    result = sb.run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)", limits=QUICK)
    waiter.join()
    listener.close()
    assert result.exit_status != 0 and accepted == []
    said = "Network is unreachable" if sb.capabilities().network_dropped else "refuses"
    assert said in result.stderr


def test_wall_time_is_a_limit_and_the_program_is_gone_after_it():
    result = sb.run_python("import time\ntime.sleep(60)", limits=sb.Limits(wall_s=0.5))
    assert result.limit == "wall" and result.exit_status < 0


def test_processes_past_the_limit_are_refused_and_none_outlives_the_program():
    result = sb.run_python("import os\nwhile True:\n    os.fork()", limits=sb.Limits(processes=4, wall_s=20))
    assert result.limit == "processes"
    sleeper = sb.run_python("import os, sys, time\nif os.fork() == 0:\n    time.sleep(60)\nprint(os.getpid())",
                            limits=QUICK)
    assert sleeper.ok  # ended at once: its child did not hold it up


def test_file_size_and_output_are_limits():
    big = sb.run_python("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)",
                        limits=sb.Limits(file_mb=0.5, wall_s=20))
    assert big.limit == "file_size"
    loud = sb.run_python("print('x' * 100000)", limits=sb.Limits(output_bytes=1000, wall_s=20))
    assert loud.limit == "output" and len(loud.stdout) == 1000


@pytest.mark.slow
def test_memory_and_cpu_are_limits():
    hog = sb.run_python("x = []\nwhile True:\n    x.append(bytearray(10 ** 6))", limits=sb.Limits(memory_mb=128, wall_s=60))
    assert hog.limit == "memory"
    spin = sb.run_python("while True:\n    pass", limits=sb.Limits(cpu_s=1, wall_s=120))
    assert spin.limit == "cpu"


def test_native_code_and_other_programs_are_refused():
    assert "loading native code" in sb.run_python("import ctypes", limits=QUICK).stderr
    assert "starting other programs" in sb.run_python("import os\nos.system('true')", limits=QUICK).stderr
