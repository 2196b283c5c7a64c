"""The command line's own behaviour (no server): a command that needs a package of an
extra the install lacks stops with one line naming it and the extra."""

import sys
from pathlib import Path

import pytest

from opentinker.cli.main import main


def test_a_command_needing_an_absent_extra_names_the_package(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "duckdb", None)  # as on a client-only install
    monkeypatch.delitem(sys.modules, "opentinker.services.core.logdb", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["query", "SELECT 1", "--data-dir", str(tmp_path)])
    assert "'duckdb' is not installed" in str(e.value) and "opentinker[server]" in str(e.value)


def test_a_bad_set_override_is_named():
    from opentinker.cli.common import load_job_config

    with pytest.raises(SystemExit, match="--set 'steps': expected KEY=VALUE"):
        load_job_config(str(Path(__file__).resolve().parents[2] / "examples" / "arith_grpo.toml"), ["steps"])


@pytest.mark.parametrize("cmd", [["query", "SELECT attempt FROM trajectories"],
                                 ["export", "SELEC 1", "--out", "x.jsonl"]])
def test_bad_sql_ends_with_duckdbs_message_not_a_traceback(tmp_path, cmd):
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--data-dir", str(tmp_path)])
    assert str(e.value).startswith("bad SQL: ") and ("attempt" in str(e.value) or "SELEC" in str(e.value)), e.value
