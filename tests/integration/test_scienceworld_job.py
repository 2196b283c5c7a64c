"""ScienceWorld trains a few steps through the real services with the tiny model: the
envhost serves the env from its module path, and multi-turn episodes land in the
Parquet log with token-exact masks, turn records, and rewards that are the simulator's
score / 100."""

import json

import pytest

from conftest import log_rows, train_jobs
from test_env_jobs import check_episode, episodes, spec, start_stack

ENV_SPEC = "opentinker.services.envhost.envs.scienceworld:ScienceWorldGame"


async def test_scienceworld_trains_and_logs_multi_turn_episodes(services, nats_url, tmp_path, tiny_model,
                                                                 job_id):
    data_dir = tmp_path / "log"
    start_stack(services, data_dir, ["--env", ENV_SPEC])
    job_spec = spec(tiny_model, "scienceworld", env_args={"task": ["find-living-thing", "find-plant"],
                                                          "max_turns": 3},
                    sampling={"max_new_tokens": 8, "max_turns": 3, "max_total_tokens": 2048})
    handles, metrics = await train_jobs(nats_url, services, {"sw": job_spec}, job_id)
    jid = handles["sw"].id
    assert [m.step for m in metrics["sw"] if m.split == "train"] == [0, 1]
    await log_rows(data_dir, f"SELECT count(*) FROM trajectories WHERE job_id = '{jid}'", 8)
    eps = episodes(data_dir, jid)
    assert len(eps) == 8 and not any(ep["error"] for ep in eps), [ep["error"] for ep in eps]
    for ep in eps:
        check_episode(ep)
        info = json.loads(ep["env_info"])
        assert info["task"] in ("find-living-thing", "find-plant")
        # the episode's reward is ScienceWorld's final score / 100 (the start's points
        # included), and every turn after the last is the env's
        assert ep["reward"] == pytest.approx(info["score"] / 100)
        assert len(ep["turns"]) == info["turn"]
        assert all(t["observation"] for t in ep["turns"][:-1])
    # the random tiny model rarely fails a task in 3 turns, so most episodes run all 3
    assert any(len(ep["turns"]) == 3 for ep in eps)
