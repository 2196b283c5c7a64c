"""A service's own temporary folder (core/tmpdir.py): made the default for the process
and its children, and the folders of killed services swept at the next start."""

import os
import subprocess
import sys
import tempfile

from opentinker.services.core.tmpdir import private_tmpdir, sweep


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_sweep_removes_the_folders_of_services_no_longer_running_and_nothing_else(tmp_path):
    dead = tmp_path / f"ot-rollout-{_dead_pid()}-abc_12"
    live = tmp_path / f"ot-learner-{os.getpid()}-xyz9"
    other = [tmp_path / "ot-swe-abc", tmp_path / "ot-rollout-notapid-abc", tmp_path / "vllm_dist_1"]
    for d in (dead, live, *other):
        d.mkdir()
        (d / "f").write_text("x")
    a_file = tmp_path / f"ot-recorder-{_dead_pid()}-file"
    a_file.write_text("a file, not a folder")
    assert sweep(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and all(d.exists() for d in other) and a_file.exists()


def test_private_tmpdir_is_the_default_of_the_process_and_what_it_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    stale = tmp_path / f"ot-rollout-{_dead_pid()}-old"
    stale.mkdir()
    d = private_tmpdir("rollout")
    try:
        assert d.parent == tmp_path and d.name.startswith(f"ot-rollout-{os.getpid()}-")
        assert oct(d.stat().st_mode & 0o777) == "0o700"
        assert tempfile.gettempdir() == str(d) and os.environ["TMPDIR"] == str(d)
        child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == str(d)
        assert not stale.exists()
    finally:
        d.rmdir()
