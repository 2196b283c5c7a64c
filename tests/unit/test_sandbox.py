"""The Python sandbox: whatever the code does, a run ends promptly with an observation
that says what happened, and the code reaches no network and no host file."""

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from opentinker.services.envhost import sandbox
from opentinker.services.envhost.sandbox import RunResult, SandboxLimits, run_python

REPO = Path(__file__).resolve().parents[2]
FAST = SandboxLimits(timeout_s=2.0)  # cpu_s 5: the wall clock ends a busy loop first


def run(code: str, limits: SandboxLimits = FAST) -> RunResult:
    """run_python, asserting it returned within the wall clock (plus start-up slack)."""
    t0 = time.monotonic()
    r = run_python(code, limits)
    assert time.monotonic() - t0 < limits.timeout_s + 1.5
    return r


def test_normal_code_prints_its_result():
    r = run("import math\nprint(sum(i * i for i in range(10)), math.factorial(5))")
    assert (r.output, r.exit_code, r.timed_out) == ("285 120\n", 0, False)
    assert r.observation() == "285 120\n"


def test_sympy_is_importable():
    r = run("import sympy\nx = sympy.symbols('x')\nprint(sympy.solve(x**2 - 4, x))",
            SandboxLimits(timeout_s=10))
    assert r.output.strip() == "[-2, 2]", r.observation()


def test_an_infinite_loop_times_out():
    r = run("print('started')\nwhile True: pass")
    assert r.timed_out and r.exit_code is None
    # output printed before the kill is kept (the interpreter runs unbuffered)
    assert r.observation() == "started\n[timed out after 2 s: the process was killed]"


def test_cpu_limit_kills_a_busy_process():
    r = run("while True: pass", SandboxLimits(timeout_s=10, cpu_s=1))
    assert not r.timed_out and r.exit_code == -24  # SIGXCPU
    assert "SIGXCPU: CPU time limit of 1 s" in r.observation()


def test_a_fork_bomb_is_contained():
    r = run("import os\nwhile True: os.fork()")
    assert r.exit_code is None or r.exit_code != 0
    assert "process limit of 32 reached" in r.observation() or r.timed_out
    # the host can still start processes
    ok = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True,
                        timeout=30, check=True)
    assert ok.stdout == "ok\n"


def test_a_fork_bomb_does_not_starve_a_run_beside_it():
    bomb = "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"
    results = {}
    t = threading.Thread(target=lambda: results.update(bomb=run(bomb)))
    t.start()
    time.sleep(0.5)  # the bomb is at its process limit
    results["calm"] = run("import subprocess, sys\n"
                          "print(subprocess.run([sys.executable, '-c', 'print(7)'], "
                          "capture_output=True, text=True).stdout)")
    t.join()
    assert results["bomb"].timed_out
    assert results["calm"].output.strip() == "7", results["calm"].observation()


def test_a_large_allocation_is_a_memory_error():
    r = run("x = bytearray(4 * 1024**3)")
    assert r.exit_code == 1 and "MemoryError" in r.output
    assert "memory limit of 512 MiB reached" in r.observation()


@pytest.mark.parametrize("path", ["/etc/passwd", str(REPO / "pyproject.toml"), str(REPO / "tests")])
def test_host_files_are_not_visible(path):
    r = run(f"import os\nprint(os.listdir({path!r}) if os.path.isdir({path!r}) else open({path!r}).read())")
    assert r.exit_code == 1 and "FileNotFoundError" in r.output, r.observation()


def test_only_the_work_dir_is_writable():
    r = run("open('notes.txt', 'w').write('kept')\nprint(open('/work/notes.txt').read())")
    assert r.output == "kept\n"
    r = run("open('/usr/evil', 'w')")
    assert "Read-only file system" in r.output


def test_each_run_starts_with_a_fresh_work_dir():
    run("open('left.txt', 'w').write('x')")
    assert run("import os\nprint(sorted(os.listdir('.')))").output == "['main.py']\n"


def test_files_given_to_a_run_sit_read_only_beside_main_py():
    r = run_python("import os\nprint(sorted(os.listdir('.')), open('data.bin', 'rb').read())\nopen('data.bin', 'wb')",
                   FAST, files={"data.bin": b"\x00payload"})
    assert r.output.startswith("['data.bin', 'main.py'] b'\\x00payload'\n") and "PermissionError" in r.output
    for name in ("../escape", "main.py", ""):
        with pytest.raises(ValueError, match="files:"):
            run_python("pass", FAST, files={name: b""})


def test_no_network_even_to_the_hosts_loopback():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        r = run("import socket\n"
                f"for addr in [('1.1.1.1', 80), ('127.0.0.1', {port})]:\n"
                "    try:\n"
                "        socket.create_connection(addr, timeout=2)\n"
                "        print('connected', addr)\n"
                "    except OSError as e:\n"
                "        print('failed', addr, type(e).__name__)\n")
        srv.settimeout(0.2)
        with pytest.raises(TimeoutError):
            srv.accept()
    assert "connected" not in r.output and r.output.count("failed") == 2, r.output


def test_output_is_truncated_with_a_marker():
    r = run("print('a' * 10_000)\nprint('the end')", SandboxLimits(timeout_s=2, max_output_chars=200))
    assert len(r.output) < 400
    assert r.output.startswith("a" * 100)
    assert "output truncated: 10009 bytes in all" in r.output
    assert r.output.endswith("the end\n")  # the tail, where errors show, is kept


def test_a_flood_of_output_is_bounded_and_cut_off_by_the_clock():
    r = run("while True: print('y' * 1000)")
    assert r.timed_out and len(r.output) < 4200 and "output truncated" in r.output


def test_a_nonzero_exit_is_said():
    assert run("import sys\nsys.exit(3)").observation() == "(no output)\n[exit code 3]"


def test_bad_limits_name_the_field():
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=0)
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=-1.0)


def test_without_bwrap_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(sandbox, "_usable", False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(sandbox.SandboxUnavailable, match=r"apt-get install bubblewrap"):
        run_python("print(1)")
