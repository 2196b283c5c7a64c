"""The documented queries over the trajectory log (services/core/queries.py) and the
export of a slice, on a log written the recorder's way: each example runs and answers
what the episodes hold; an export reads back the same rows."""

import json

import pyarrow.parquet as pq
import pytest

from opentinker.schemas import Metrics, Trajectory, TurnRecord
from opentinker.services.core.logdb import export_query, run_query
from opentinker.services.core.queries import EXAMPLES
from opentinker.services.recorder.store import metrics_rows, trajectory_rows, write_part


def episode(step: int, k: int, reward: float, env_ms: float) -> Trajectory:
    turns = [TurnRecord(gen_start=2, gen_end=4, obs_end=6, reward=0.0, policy_version=step, env_ms=env_ms),
             TurnRecord(gen_start=6, gen_end=9, obs_end=9, reward=reward, policy_version=step, env_ms=env_ms)]
    return Trajectory(job_id="j", request_id=f"r{step}", episode_id=f"e{step}-{k}", step=step, group_index=0,
                      group_size=2, token_ids=list(range(9)), loss_mask=[0, 0, 1, 1, 0, 0, 1, 1, 1],
                      logprobs=[0.0] * 9, prompt_len=2, turns=turns, reward=reward,
                      policy_version=max(0, step - k), env="guess" if k else "arith", env_ms=2 * env_ms)


@pytest.fixture
def log(tmp_path):
    eps = [episode(step, k, float(k), 10.0 * (k + 1)) for step in (0, 1) for k in (0, 1)]
    write_part(tmp_path, "trajectories", "j", [r for seq, t in enumerate(eps, 1) for r in trajectory_rows(t, seq)])
    ms = [Metrics(job_id="j", step=s, policy_version=s, values={"reward_mean": 0.5, "kl": 0.01}) for s in (0, 1)]
    write_part(tmp_path, "metrics", "j", [r for seq, m in enumerate(ms, 1) for r in metrics_rows(m, seq)])
    return tmp_path


def query(name: str, log) -> list[dict]:
    cols, rows = run_query(EXAMPLES[name].format(job="j"), log)
    return [dict(zip(cols, r)) for r in rows]


def test_the_documented_queries_answer_from_the_log(log):
    assert query("reward-by-step", log) == [
        {"step": 0, "reward": 0.5, "episodes": 2, "policy_tokens": 5.0},
        {"step": 1, "reward": 0.5, "episodes": 2, "policy_tokens": 5.0}]
    turns = query("per-turn", log)
    assert ([(t["turn_no"], t["episodes"], t["reward"], t["tokens"]) for t in turns]
            == [(1, 4, 0.0, 2.0), (2, 4, 0.5, 3.0)])
    lag = query("policy-lag", log)
    assert [(r["step"], r["max_lag"]) for r in lag] == [(0, 0), (1, 1)]
    slow = query("slowest-envs", log)
    assert [r["env"] for r in slow] == ["guess", "arith"] and slow[0]["env_ms_mean"] == 40.0
    assert {(r["key"], r["step"]) for r in query("metric", log)} == {("kl", 0), ("kl", 1), ("reward_mean", 0),
                                                                   ("reward_mean", 1)}


def test_a_slice_exports_to_parquet_and_jsonl(log, tmp_path):
    sql = "SELECT episode_id, reward, token_ids, loss_mask FROM trajectories WHERE reward = 1 ORDER BY episode_id"
    assert export_query(sql, log, tmp_path / "out" / "wins.parquet") == 2
    table = pq.read_table(tmp_path / "out" / "wins.parquet").to_pylist()
    assert [r["episode_id"] for r in table] == ["e0-1", "e1-1"] and table[0]["loss_mask"][2] == 1
    assert export_query(sql, log, tmp_path / "wins.jsonl") == 2
    rows = [json.loads(line) for line in (tmp_path / "wins.jsonl").read_text().splitlines()]
    assert rows == [{k: (list(v) if isinstance(v, list) else v) for k, v in r.items()} for r in table]
    with pytest.raises(ValueError, match="parquet or .jsonl"):
        export_query(sql, log, tmp_path / "wins.csv")


def test_plot_writes_a_chart_per_metric_and_episodes_show_the_mask(log, tmp_path):
    from opentinker.cli.views import episodes, plot

    files = plot("j", log, tmp_path / "plots")
    assert [f.name for f in files] == ["reward.png", "kl.png", "overview.png"]  # the metrics the log has
    assert all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000 for f in files)
    with pytest.raises(LookupError):
        plot("nope", log, tmp_path / "none")

    eps = episodes("j", 1, log, limit=5)
    assert [e["episode_id"] for e in eps] == ["e1-0", "e1-1"]
    roles = [(role, mask, n) for role, _, mask, n in eps[0]["segments"]]
    assert roles == [("prompt", 0, 2), ("action", 1, 2), ("observation", 0, 2), ("action", 1, 3)]


def test_the_steps_view_names_what_each_step_trained_on_after_a_redo(tmp_path):
    """A step a lost learner run had trained and reported is trained again by the resumed
    run: the `steps` view keeps the resumed run's groups only, once each, even when a
    report was written twice (a recorder crash between write and ack)."""
    from opentinker.services.recorder.store import step_rows

    lost = Metrics(job_id="j", step=1, policy_version=2, groups=["j-s1-g0-rLOST", "j-s1-g1-rLOST"])
    redo = Metrics(job_id="j", step=1, policy_version=2, groups=["j-s1-g0-rNEW", "j-s1-g1-a1-rNEW"])
    first = Metrics(job_id="j", step=0, policy_version=1, groups=["j-s0-g0-rLOST", "j-s0-g1-rLOST"])
    evaluation = Metrics(job_id="j", step=1, policy_version=1, split="eval", groups=["not-a-step"])
    rows = [*step_rows(first, 3), *step_rows(lost, 5), *step_rows(redo, 9), *step_rows(redo, 9),
            *step_rows(evaluation, 10)]
    write_part(tmp_path, "steps", "j", rows)
    _, got = run_query("SELECT step, request_id FROM steps ORDER BY step, request_id", tmp_path)
    assert got == [(0, "j-s0-g0-rLOST"), (0, "j-s0-g1-rLOST"), (1, "j-s1-g0-rNEW"), (1, "j-s1-g1-a1-rNEW")]
