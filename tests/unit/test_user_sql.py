"""A tenant's SQL over the trajectory log (`sft_query`, logdb.run_user_query): it sees
only the rows of the tenant's own jobs, can read and write no file (so no file's
contents can come back in an error), runs one SELECT and nothing else; a legitimate
query still replays the same examples."""

from __future__ import annotations

import os

import pytest

from opentinker.schemas import JobState, JobStateChanged, Metrics, Trajectory, TurnRecord
from opentinker.services.core.logdb import run_user_query
from opentinker.services.learner.sft import Example, examples_from_query
from opentinker.services.recorder.store import event_rows, metrics_rows, trajectory_rows, write_part

ALICE, BOB = "alice-job", "bob-job"
SECRET = "TOPSECRET-6f1d2c-nkey"


def _traj(job_id: str, k: int, reward: float) -> Trajectory:
    ids = [1, 100 + k, 200 + k, 2, 400 + k, 2]
    mask = [0, 0, 0, 0, 1, 1]
    return Trajectory(job_id=job_id, request_id=f"{job_id}-s0-g0", episode_id=f"{job_id}-e{k}", step=0,
                      group_index=0, group_size=4, token_ids=ids, loss_mask=mask, logprobs=[0.0] * 6,
                      prompt_len=4, turns=[TurnRecord(gen_start=4, gen_end=6, obs_end=6, reward=reward)],
                      reward=reward, policy_version=0, env="arith")


@pytest.fixture
def log(tmp_path):
    """Two jobs of two users, written the recorder's way: alice's 3 episodes (one of
    them written twice, as after a redelivery), bob's 2; a metric and an event each."""
    d = tmp_path / "data"
    trajs = {ALICE: [_traj(ALICE, k, r) for k, r in enumerate([1.0, 0.0, 1.0])],
             BOB: [_traj(BOB, k, r) for k, r in enumerate([1.0, 1.0])]}
    for job, ts in trajs.items():
        write_part(d, "trajectories", job, [r for seq, t in enumerate(ts, 1) for r in trajectory_rows(t, seq)])
        m = Metrics(job_id=job, step=0, policy_version=0, values={"loss": 1.0})
        write_part(d, "metrics", job, metrics_rows(m, 1))
        write_part(d, "events", job, event_rows(JobStateChanged(job_id=job, state=JobState.RUNNING), 1))
    write_part(d, "trajectories", ALICE, trajectory_rows(trajs[ALICE][0], 9))  # the same episode again
    return d, trajs


@pytest.fixture
def secret(tmp_path):
    p = tmp_path / "service.nk"
    p.write_text(SECRET + "\n")
    return p


def _refused(sql: str, data_dir, job_ids=(ALICE,)) -> str:
    with pytest.raises(ValueError) as e:
        run_user_query(sql, data_dir, job_ids)
    msg = str(e.value)
    assert msg.startswith("sft_query:"), msg
    return msg


# -- no files -----------------------------------------------------------------------

@pytest.mark.parametrize("sql", [
    # the cast error would carry the file's text
    "SELECT CAST(content AS INT) AS token_ids, [1] AS loss_mask FROM read_text('{secret}')",
    "SELECT CAST(read_text('{secret}') AS INT)",
    "SELECT * FROM read_csv('{secret}', header = false)",
    "SELECT * FROM read_blob('{secret}')",
    "SELECT * FROM '{secret}'",
    "SELECT * FROM sniff_csv('{secret}')",
    "SELECT * FROM glob('{secret}')",
    "SELECT * FROM query('SELECT * FROM read_text(''{secret}'')')",
    "WITH t AS (SELECT content FROM read_text('{secret}')) SELECT CAST(content AS INT) FROM t",
])
def test_a_secret_file_cannot_be_read_nor_leak_into_the_error(log, secret, sql):
    msg = _refused(sql.format(secret=secret), log[0])
    assert SECRET not in msg


def test_the_process_environment_cannot_be_read(log):
    msg = _refused("SELECT CAST(content AS INT) FROM read_text('/proc/self/environ')", log[0])
    assert "PATH=" not in msg and "Permission" in msg
    _refused("SELECT * FROM read_csv('/etc/passwd', sep = ':')", log[0])


def test_examples_from_query_does_not_leak_a_file(log, secret):
    sql = f"SELECT CAST(content AS INT[]) AS token_ids, [1] AS loss_mask FROM read_text('{secret}')"
    with pytest.raises(ValueError) as e:
        examples_from_query(sql, log[0], job_ids=[ALICE])
    assert str(e.value).startswith("sft_query:") and SECRET not in str(e.value)


def test_copy_writes_no_file(log, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for target in ("x", str(tmp_path / "out.csv")):
        msg = _refused(f"COPY (SELECT * FROM trajectories) TO '{target}'", log[0])
        assert "exactly one SELECT" in msg and "COPY" in msg
    assert not (tmp_path / "x").exists() and not (tmp_path / "out.csv").exists()


@pytest.mark.parametrize("sql, kind", [
    ("ATTACH '{tmp}/other.db' AS other", "ATTACH"),
    ("INSTALL httpfs", "LOAD"),
    ("LOAD httpfs", "LOAD"),
    ("SET enable_external_access = true", "SET"),
    ("RESET lock_configuration", "SET"),
    ("SET memory_limit = '100GB'", "SET"),
    ("PRAGMA enable_profiling", "PRAGMA"),
    ("CREATE TABLE t AS SELECT * FROM trajectories", "CREATE"),
    ("DELETE FROM trajectories", "DELETE"),
    ("EXPORT DATABASE '{tmp}/dump'", "EXPORT"),
    ("SELECT 1; SELECT 2", "SELECT, SELECT"),
    ("SELECT * FROM trajectories; COPY trajectories TO '{tmp}/t.csv'", "SELECT, COPY"),
    ("", "nothing"),
])
def test_only_one_select_statement_runs(log, tmp_path, sql, kind):
    msg = _refused(sql.format(tmp=tmp_path), log[0])
    assert "exactly one SELECT" in msg and f"(got {kind})" in msg
    assert not (tmp_path / "other.db").exists() and not (tmp_path / "dump").exists()
    assert not (tmp_path / "t.csv").exists()


def test_settings_cannot_be_changed_from_inside_a_select(log):
    msg = _refused("SELECT * FROM query('SET enable_external_access = true')", log[0])
    assert "the query failed" in msg


def test_a_runaway_query_is_stopped_and_a_huge_result_refused(log):
    with pytest.raises(ValueError, match=r"sft_query: the query ran longer than 0.5 s"):
        run_user_query("SELECT count(*) FROM range(10000000000) a, range(10) b WHERE (a.range * b.range) % 7 = 3",
                       log[0], [ALICE], timeout_s=0.5)
    with pytest.raises(ValueError, match="more than 10 rows"):
        run_user_query("SELECT * FROM range(11)", log[0], [ALICE], max_rows=10)
    assert len(run_user_query("SELECT * FROM range(10)", log[0], [ALICE], max_rows=10)[1]) == 10


def test_bad_sql_names_sft_query(log):
    assert "the query failed" in _refused("SELEC * FROM trajectories", log[0])
    assert "the query failed" in _refused("SELECT * FROM nowhere", log[0])


@pytest.mark.parametrize("job_id", ["../bob-job", "ALICE", "a/b", "", "x" * 64])
def test_job_ids_are_validated_before_they_become_paths(log, job_id):
    with pytest.raises(ValueError, match="sft_query: job id .* must match"):
        run_user_query("SELECT 1", log[0], [job_id])


# -- only one's own rows -------------------------------------------------------------

def test_only_the_tenants_own_rows_are_visible(log):
    d = log[0]

    def one(sql, job_ids=(ALICE,)):
        return run_user_query(sql, d, job_ids)[1]

    assert one("SELECT count(*) FROM trajectories") == [(3,)]  # one copy of the duplicate
    assert one(f"SELECT count(*) FROM trajectories WHERE job_id = '{BOB}'") == [(0,)]
    assert one(f"SELECT * FROM trajectories WHERE job_id = '{BOB}'") == []
    assert one("SELECT DISTINCT job_id FROM metrics UNION SELECT DISTINCT job_id FROM events") == [(ALICE,)]
    assert one("SELECT count(*) FROM trajectories", (BOB,)) == [(2,)]
    # an admin (None) sees every job, still with one row per episode
    assert one("SELECT job_id, count(*) FROM trajectories GROUP BY job_id ORDER BY job_id", None) == [
        (ALICE, 3), (BOB, 2)]
    # a tenant with no rows yet gets empty tables with the log's columns
    cols, rows = run_user_query("SELECT episode_id, token_ids, turns FROM trajectories", d, ["carol-job"])
    assert cols == ["episode_id", "token_ids", "turns"] and rows == []


def test_a_legitimate_query_replays_the_same_examples(log):
    d, trajs = log
    sql = f"SELECT * FROM trajectories WHERE job_id = '{ALICE}' AND reward = 1 ORDER BY episode_id"
    got = examples_from_query(sql, d, job_ids=[ALICE])
    assert got == [Example(list(t.token_ids), list(t.loss_mask)) for t in (trajs[ALICE][0], trajs[ALICE][2])]
    assert examples_from_query(sql, d, job_ids=None) == got
    with pytest.raises(ValueError, match="sft_query: the query returned no rows"):
        examples_from_query(f"SELECT * FROM trajectories WHERE job_id = '{ALICE}'", d, job_ids=[BOB])


def test_the_log_on_disk_is_untouched(log):
    d = log[0]
    before = sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)
    run_user_query("SELECT * FROM trajectories", d, [ALICE])
    _refused("DELETE FROM trajectories", d)
    assert sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs) == before
