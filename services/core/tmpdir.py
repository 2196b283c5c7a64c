"""A service process's own temporary folder.

vLLM, torch and the libraries under them put their run-time files in `tempfile`'s
folder: vLLM's ZeroMQ IPC sockets (`VLLM_RPC_BASE_PATH`, one per engine client) and its
single-process rendezvous files (`vllm_dist_<uuid>`), torch's and triton's scratch.
Nothing removes them when a process is killed, so a host that runs services for weeks
collects thousands of them in /tmp. Each service therefore gives itself a folder,
`<tmp>/ot-<service>-<pid>-<random>`, points `TMPDIR` (for the processes it starts) and
`tempfile.tempdir` (for itself) at it, and removes it when it stops; a service that
starts removes the folders this user's services on this host left behind when they were
killed (their pid no longer runs).

The folder stays in the system's temporary folder rather than under the OpenTinker home,
and its name is short: a socket's path must fit in 107 bytes (AF_UNIX), vLLM adds 37 to
the folder's, and a service started by another process with such a folder (a test
session's) makes its own inside that one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "ot-"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep(base: Path) -> list[Path]:
    """Remove the folders under `base` of this user's services that no longer run (the
    pid in the name is gone); returns them. Another user's folders, and names not of the
    form `ot-<service>-<pid>-<random>`, are left alone."""
    removed = []
    for d in base.glob(f"{PREFIX}*-*-*"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(d.name.rsplit("-", 2)[-2])
            if d.is_dir() and not d.is_symlink() and d.stat().st_uid == os.getuid() and not _running(pid):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
    return removed


def new_tmpdir(service: str) -> Path:
    """A fresh temporary folder (mode 0700) named for `service` and this process, made
    after the folders of killed services are swept. The caller removes it
    (`shutil.rmtree`) when it stops. Raises OSError when the temporary folder cannot be
    written."""
    base = Path(tempfile.gettempdir())
    sweep(base)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{service}-{os.getpid()}-", dir=base))


def private_tmpdir(service: str) -> Path:
    """new_tmpdir(service), made the default of this process (`tempfile.tempdir`) and of
    those it starts (`TMPDIR`)."""
    d = new_tmpdir(service)
    os.environ["TMPDIR"] = str(d)
    tempfile.tempdir = str(d)
    return d
