"""Hub environments train through the real services: a verifiers multi-turn env and an
OpenEnv Environment (tests/fixtures/hub_envs.py, written against each library's own API),
served by one envhost chosen on its command line, each train two steps with the tiny
model, and their episodes land in the Parquet log with the turns, masks and the rewards
the env's own rubric or observations give for the logged text."""

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import log_rows, train_jobs
from test_env_jobs import check_episode, episodes, spec, start_stack

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"



async def test_verifiers_and_openenv_envs_train_and_log_their_episodes(services, nats_url, tmp_path,
                                                                       tiny_model, job_id):
    data_dir = tmp_path / "log"
    start_stack(services, data_dir, ["--env-path", str(FIXTURES), "--env", "verifiers:hub_envs",
                                     "--env", f"openenv:{FIXTURES / 'hub_envs.py'}:CountEnvironment"])
    mspec = importlib.util.spec_from_file_location("hub_envs_check", FIXTURES / "hub_envs.py")
    hub = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(hub)  # the reward functions, to recompute the logged rewards
    jobs = {
        # max_turns as the env's, so the env (not the job) ends each episode and scores it
        "hub_envs": spec(tiny_model, "hub_envs",
                         sampling={"max_new_tokens": 6, "max_turns": hub.MULTI_MAX_TURNS,
                                   "max_total_tokens": 1024}),
        "count": spec(tiny_model, "count",
                      sampling={"max_new_tokens": 6, "max_turns": hub.COUNT_MAX_STEPS, "max_total_tokens": 1024}),
    }
    handles, metrics = await train_jobs(nats_url, services, jobs, job_id)
    for env in jobs:
        assert [m.step for m in metrics[env] if m.split == "train"] == [0, 1], env
    for env, h in handles.items():
        n = jobs[env]["steps"] * jobs[env]["prompts_per_step"] * jobs[env]["group_size"]
        await log_rows(data_dir, f"SELECT count(*) FROM trajectories WHERE job_id = '{h.id}'", n)
        eps = episodes(data_dir, h.id)
        assert len(eps) == n, env
        for ep in eps:
            assert not ep["error"], ep["error"]
            check_episode(ep)
            info = json.loads(ep["env_info"])
            turns = ep["turns"]
            if env == "hub_envs":
                # the rubric's score, on the final turn, for the logged replies
                completion = [{"role": "assistant", "content": t["action"]} for t in turns]
                want = (hub.MULTI_WEIGHTS[0] * hub.guessed_in(completion, info["answer"])
                        + hub.MULTI_WEIGHTS[1] * hub.turns_used(completion))
                assert ep["reward"] == pytest.approx(want), (turns, info)
                assert [t["reward"] for t in turns[:-1]] == [0.0] * (len(turns) - 1)
                assert info["metrics"]["turns_used"] == len(turns)
                assert info["stop_condition"] in ("guessed", "max_turns_reached")
                if info["stop_condition"] == "max_turns_reached":
                    assert len(turns) == hub.MULTI_MAX_TURNS
                # the env's answers are the observations, masked out of the loss
                assert all(t["observation"] in ("Higher.", "Lower.", "Not a number.") for t in turns[:-1])
            else:
                target = info["state"]["target"]
                assert [t["reward"] for t in turns] == pytest.approx(
                    [hub.count_reward(t["action"], target) for t in turns])
                assert info["state"]["said"] == [t["action"] for t in turns]
                assert len(turns) == hub.COUNT_MAX_STEPS or len(turns[-1]["action"].split()) == target
        assert any(len(ep["turns"]) > 1 for ep in eps), env
