"""Run untrusted Python (a model's code) in a separate, locked-down process.

Isolation is bubblewrap's (`bwrap`, Debian package `bubblewrap`): new network, PID,
IPC and UTS namespaces, and a root filesystem that holds only the OS libraries (/usr,
read-only), the Python installation (read-only), a few chosen packages from this
environment's site-packages (read-only; sympy, mpmath, numpy by default) and a fresh
`/work` tmpfs, the only writable place, gone when the run ends (it starts with the code
as main.py and any `files` given, read-only). Nothing else of the
host (no /etc, no $HOME, no repository) is visible, and no network is reachable.

Resource limits are rlimits set inside the sandbox just before the code runs: CPU
seconds, address space, processes, file size, open files, no core files. The wall
clock is the parent's: after `timeout_s` it SIGKILLs bwrap, and with bwrap's PID
namespace and `--die-with-parent` every process of the run goes with it, so
`run_python` always returns, within about `timeout_s` + 0.1 s.

Processes: the kernel does not enforce RLIMIT_NPROC for global uid 0, and a user
namespace made by root maps its uid back to 0. So when we run as root, bwrap runs
privileged (no user namespace) and the code drops to a uid of its own, different per
run (a fork bomb in one run cannot starve another); as another user, bwrap makes a
user namespace, whose process count (kernel >= 5.14) is per namespace.
"""

from __future__ import annotations

import functools
import importlib.metadata
import itertools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

#: packages bound into the sandbox when installed here (distribution names)
DEFAULT_PACKAGES = ("sympy", "mpmath", "numpy")

_INSTALL_HINT = "install bubblewrap (apt-get install bubblewrap)"
# Per-run uids for root mode: high, unlikely to name a real account, spread by our pid
# so two envhost processes on one machine do not share a process count either.
_UID_BASE = 1 << 30
_runs = itertools.count()
_VENV = "/venv"  # where the sandbox's own venv (interpreter + chosen packages) appears
_WORK = "/work"
# bwrap exits 128 + N when the code died of signal N; these are the signals a limit
# (or a crash at one) sends, read as such rather than as an exit status.
_LIMIT_SIGNALS = {signal.SIGKILL, signal.SIGXCPU, signal.SIGXFSZ, signal.SIGSEGV,
                  signal.SIGABRT, signal.SIGBUS}


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot make a sandbox on this machine."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run.

    timeout_s:        wall clock, seconds, after which every process of the run is killed
    cpu_s:            CPU seconds per process (RLIMIT_CPU; SIGXCPU past it)
    memory_mb:        address space per process, MiB (RLIMIT_AS; MemoryError past it)
    max_processes:    processes and threads of the run (RLIMIT_NPROC)
    max_file_mb:      largest file the code may write, MiB (RLIMIT_FSIZE)
    max_open_files:   open file descriptors per process (RLIMIT_NOFILE)
    disk_mb:          size of the /work tmpfs, MiB (counts as memory of the host)
    max_output_chars: stdout+stderr kept; beyond it the middle is cut with a marker

    Raises ValueError naming the field for a value that is not a positive number.
    """

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    disk_mb: int = 64
    max_output_chars: int = 4000

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            ok = isinstance(v, (int, float)) if f.name == "timeout_s" else isinstance(v, int)
            if isinstance(v, bool) or not ok or v <= 0:
                raise ValueError(f"{f.name}: must be a positive {f.type}, got {v!r}")


@dataclass(frozen=True)
class RunResult:
    """What one run did.

    output:     stdout and stderr interleaved, cut to `limits.max_output_chars`
    exit_code:  the interpreter's exit status; -N when it died of signal N (CPU or file
                size limit, killed); None when it timed out (we killed it)
    timed_out:  True when the wall clock ran out
    duration_s: wall-clock seconds from start to reaped
    """

    output: str
    exit_code: int | None
    timed_out: bool
    duration_s: float
    limits: SandboxLimits = SandboxLimits()

    def observation(self) -> str:
        """The text a model sees: the output, then one line saying how the run ended
        when it did not end normally (timeout, signal, memory, nonzero exit)."""
        lim = self.limits
        out = self.output if self.output.strip() else "(no output)"
        if self.timed_out:
            note = f"[timed out after {lim.timeout_s:g} s: the process was killed]"
        elif self.exit_code is not None and self.exit_code < 0:
            sig = -self.exit_code
            why = {signal.SIGXCPU: f"CPU time limit of {lim.cpu_s} s",
                   signal.SIGXFSZ: f"file size limit of {lim.max_file_mb} MiB"}.get(sig, "")
            note = f"[killed by signal {signal.Signals(sig).name}{': ' + why if why else ''}]"
        elif self.exit_code:
            note = f"[exit code {self.exit_code}]"
            if "MemoryError" in self.output:
                note += f" [memory limit of {lim.memory_mb} MiB reached]"
            if "BlockingIOError: [Errno 11]" in self.output:
                note += f" [process limit of {lim.max_processes} reached]"
        else:
            return out
        return f"{out.rstrip()}\n{note}"


def run_python(code: str, limits: SandboxLimits = SandboxLimits(),
               packages: tuple[str, ...] = DEFAULT_PACKAGES,
               files: Mapping[str, bytes] | None = None) -> RunResult:
    """Run `code` as `python -I main.py` in a fresh sandbox (see the module docstring).

    `packages`: distributions of this environment to make importable (read-only), when
    installed. `files`: name -> bytes of more files placed read-only beside main.py in
    /work (e.g. an archive the code unpacks); they count toward `limits.disk_mb`.
    Returns within about `limits.timeout_s` + 0.1 s, whatever the code does.
    Raises SandboxUnavailable when bwrap is missing or cannot make a sandbox here, and
    ValueError for a file name that is not a plain name (empty, "/", ".", "..", main.py).
    """
    check()
    files = dict(files or {})
    for name in files:
        if not name or "/" in name or "\0" in name or name in (".", "..", "main.py"):
            raise ValueError(f"files: {name!r} is not a plain file name other than main.py")
    code_fd = _memfd("main.py", code.encode("utf-8", "surrogatepass"))
    cfg_fd = _memfd("pyvenv.cfg", _pyvenv_cfg().encode())
    file_fds = {name: _memfd(name, data) for name, data in files.items()}
    root = os.geteuid() == 0
    uid = _UID_BASE + (((os.getpid() & 0xFFFF) << 10) | (next(_runs) & 0x3FF)) if root else None
    cmd = [*_bwrap_args(root, limits, cfg_fd, code_fd, _package_binds(packages), file_fds),
           f"{_VENV}/bin/python", "-I", "-S", "-c", _bootstrap(limits, uid)]
    start = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=(code_fd, cfg_fd, *file_fds.values()),
                                start_new_session=True)
    finally:
        for fd in (code_fd, cfg_fd, *file_fds.values()):
            os.close(fd)
    out = _Output(limits.max_output_chars)
    try:
        timed_out = not _drain(proc, out, start + limits.timeout_s)
    finally:  # timed out, or interrupted: no process of the run outlives the call
        if proc.returncode is None:
            _kill(proc)
    duration_s = time.monotonic() - start
    rc = proc.returncode
    if rc is not None and rc > 128 and rc - 128 in _LIMIT_SIGNALS:
        rc = 128 - rc
    return RunResult(output=out.text(), exit_code=None if timed_out else rc,
                     timed_out=timed_out, duration_s=duration_s, limits=limits)


def _drain(proc: subprocess.Popen, out: _Output, deadline: float) -> bool:
    """Read `proc`'s output until it exits; False if `deadline` (monotonic) came first."""
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if sel.select(left):
                    chunk = os.read(fd, 65536)
                    if not chunk:  # every process of the run has closed its output
                        break
                    out.add(chunk)
        # Output closed but a process may live on (it closed fd 1 and 2 itself).
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True
    finally:
        proc.stdout.close()


def _kill(proc: subprocess.Popen) -> None:
    # The session holds bwrap and its PID-1 helper; when they die the kernel kills the
    # rest of the run's PID namespace, whatever sessions or groups the code made.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class _Output:
    """stdout+stderr, bounded: keeps the first and last few KiB of any amount of bytes."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.keep_b = 4 * max_chars  # up to 4 UTF-8 bytes a character
        self.head = bytearray()
        self.tail = bytearray()
        self.total_b = 0

    def add(self, chunk: bytes) -> None:
        self.total_b += len(chunk)
        room = self.keep_b - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            del self.tail[:-self.keep_b]

    def text(self) -> str:
        head = self.head.decode("utf-8", "replace")
        tail = self.tail.decode("utf-8", "replace")
        if self.total_b == len(self.head) + len(self.tail):
            head, tail = head + tail, ""
            if len(head) <= self.max_chars:
                return head
        half = self.max_chars // 2
        if not tail:
            head, tail = head[:half], head[half:]
        return (f"{head[:half]}\n[... output truncated: {self.total_b} bytes in all; the first "
                f"and last {half} characters are shown ...]\n{tail[-half:] if half else ''}")


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@functools.cache
def _interpreter() -> tuple[str, str, str]:
    """(real interpreter path, real base prefix, "pythonX.Y"): a venv's python is only
    a symlink, so the sandbox binds the installation it points to."""
    exe = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
    return exe, os.path.realpath(sys.base_prefix), f"python{sys.version_info[0]}.{sys.version_info[1]}"


def _pyvenv_cfg() -> str:
    # The sandbox's python is /venv/bin/python, a symlink to the real interpreter; this
    # file makes it a venv, so its site-packages is /venv/lib/... and nothing else.
    exe, _, _ = _interpreter()
    return f"home = {os.path.dirname(exe)}\ninclude-system-site-packages = false\n"


@functools.cache
def _package_binds(packages: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(host path, name in site-packages) of every top-level file or folder that the
    installed distributions `packages` own (a missing one is skipped)."""
    binds: dict[str, str] = {}
    for name in packages:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            top = f.parts[0]
            src = Path(dist.locate_file(top))
            if top not in ("..", "__pycache__") and src.exists():
                binds[top] = str(src)
    return tuple((src, top) for top, src in sorted(binds.items()))


def _bwrap_args(root: bool, limits: SandboxLimits, cfg_fd: int, code_fd: int | None,
                packages: tuple[tuple[str, str], ...], file_fds: Mapping[str, int] | None = None) -> list[str]:
    """bwrap's options, up to the command: `cfg_fd` holds pyvenv.cfg, `code_fd` main.py,
    `file_fds` name -> fd of the other files placed in /work."""
    exe, prefix, pyver = _interpreter()
    site = f"{_VENV}/lib/{pyver}/site-packages"
    a = ["bwrap", "--die-with-parent", "--new-session",
         "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
         "--unshare-cgroup-try", "--hostname", "sandbox"]
    if not root:
        a += ["--unshare-user", "--disable-userns"]
    a += ["--ro-bind", "/usr", "/usr"]
    for d in ("bin", "lib", "lib32", "lib64", "sbin"):
        host = Path("/") / d
        if host.is_symlink():  # merged /usr: /lib -> usr/lib
            a += ["--symlink", os.readlink(host), f"/{d}"]
        elif host.is_dir():
            a += ["--ro-bind", str(host), f"/{d}"]
    if not (prefix + "/").startswith("/usr/"):
        a += [*_parents(prefix), "--ro-bind", prefix, prefix]
    # The installation's own site-packages (pytest, IPython, ...) is hidden, not just
    # left off sys.path.
    base_site = sysconfig.get_path("purelib", vars={"base": prefix, "platbase": prefix})
    if os.path.isdir(base_site):
        a += ["--tmpfs", base_site]
    a += ["--proc", "/proc", "--dev", "/dev",
          *_parents(f"{_VENV}/bin/python"), "--symlink", exe, f"{_VENV}/bin/python",
          "--perms", "0444", "--ro-bind-data", str(cfg_fd), f"{_VENV}/pyvenv.cfg",
          "--dir", site]
    for src, top in packages:
        a += ["--ro-bind", src, f"{site}/{top}"]
    a += ["--perms", "1777", "--size", str(limits.disk_mb << 20), "--tmpfs", _WORK]
    if code_fd is not None:
        a += ["--perms", "0444", "--file", str(code_fd), f"{_WORK}/main.py"]
    for name, fd in (file_fds or {}).items():
        a += ["--perms", "0444", "--file", str(fd), f"{_WORK}/{name}"]
    # Last, once every mount point in it exists: the root tmpfs becomes read-only.
    a += ["--remount-ro", "/"]
    a += ["--chdir", _WORK, "--clearenv",
          "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", _WORK,
          "--setenv", "TMPDIR", _WORK, "--setenv", "LANG", "C.UTF-8"]
    # BLAS and OpenMP start a thread per core; threads count as processes and address
    # space, so one is what the limits have room for.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        a += ["--setenv", var, "1"]
    return a


def _parents(path: str) -> list[str]:
    # bwrap makes a missing parent of a mount point mode 0700, which the dropped uid
    # could not pass through; --dir makes it 0755.
    return [x for p in reversed(Path(path).parents) if str(p) != "/" for x in ("--dir", str(p))]


def _bootstrap(limits: SandboxLimits, uid: int | None) -> str:
    """The `-c` program run inside before the code: set the rlimits, drop to `uid`
    (root mode), exec the code. Python flags: -I isolated, -B no .pyc, -u unbuffered (a
    killed run still shows what it printed), -X utf8."""
    mib = 1 << 20
    rl = {"RLIMIT_AS": limits.memory_mb * mib,
          "RLIMIT_NPROC": limits.max_processes, "RLIMIT_FSIZE": limits.max_file_mb * mib,
          "RLIMIT_NOFILE": limits.max_open_files, "RLIMIT_CORE": 0}
    lines = ["import os, resource as r"]
    lines += [f"r.setrlimit(r.{k}, ({v}, {v}))" for k, v in rl.items()]
    # At the hard CPU limit the kernel sends SIGKILL; a second later than the soft one,
    # SIGXCPU comes first and says why.
    lines.append(f"r.setrlimit(r.RLIMIT_CPU, ({limits.cpu_s}, {limits.cpu_s + 1}))")
    if uid is not None:
        lines += ["os.setgroups([])", f"os.setgid({uid})", f"os.setuid({uid})"]
    py = f"{_VENV}/bin/python"
    lines.append(f"os.execv({py!r}, [{py!r}, '-I', '-B', '-u', '-X', 'utf8', 'main.py'])")
    return "\n".join(lines)


_usable = False


def check() -> None:
    """Raise SandboxUnavailable unless bwrap exists and can make a sandbox here
    (tried once per process; a success is remembered)."""
    global _usable
    if _usable:
        return
    if shutil.which("bwrap") is None:
        raise SandboxUnavailable(f"bwrap not found on PATH: {_INSTALL_HINT}")
    cfg_fd = _memfd("pyvenv.cfg", _pyvenv_cfg().encode())
    try:
        r = subprocess.run([*_bwrap_args(os.geteuid() == 0, SandboxLimits(), cfg_fd, None, ()),
                            f"{_VENV}/bin/python", "-I", "-S", "-c", "pass"], stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, pass_fds=(cfg_fd,), timeout=30,
                           check=False)
    finally:
        os.close(cfg_fd)
    if r.returncode != 0:
        need = "" if os.geteuid() == 0 else ", and allow unprivileged user namespaces"
        raise SandboxUnavailable(f"bwrap cannot make a sandbox here ({r.stderr.strip()}): "
                                 f"{_INSTALL_HINT}{need}")
    _usable = True
