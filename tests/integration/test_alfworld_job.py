"""ALFWorld trains a few steps through the real services with the tiny model: the
envhost serves the env from its module path, its process environment names the data
(ALFWORLD_DATA, the operator's setting, made offline by the package's own generator in
tests/fixtures/alfworld_games.py), and multi-turn episodes land in the Parquet log with
token-exact masks, turn records and ALFWorld's rewards; evaluation plays the
valid_unseen games."""

import json

import pytest

from fixtures.alfworld_games import shared_alfworld_data
from conftest import log_rows, train_jobs
from test_env_jobs import check_episode, episodes, spec

ENV_SPEC = "opentinker.services.envhost.envs.alfworld:AlfWorldGame"
WELCOME = "-= Welcome to TextWorld, ALFRED! =-"


@pytest.fixture(scope="module")
def alfworld_data(tmp_path_factory):
    return shared_alfworld_data(tmp_path_factory)  # generated once per run (the unit tests' too)


async def test_alfworld_trains_and_logs_multi_turn_episodes(services, nats_url, tmp_path, tiny_model, job_id,
                                                            alfworld_data):
    from transformers import AutoTokenizer

    data_dir = tmp_path / "log"
    for name in ("scheduler", "learner"):
        services.start(name)
    services.start("envhost", args=["--env", ENV_SPEC], env={"ALFWORLD_DATA": str(alfworld_data)})
    services.start("rollout", "engine=hf")
    services.start("recorder", f"data_dir={data_dir}", "recorder_flush_s=0.5")
    job_spec = spec(tiny_model, "alfworld", env_args={"max_turns": 3}, eval_every=2, eval_episodes=1,
                    sampling={"max_new_tokens": 8, "max_turns": 3, "max_total_tokens": 1536})
    handles, metrics = await train_jobs(nats_url, services, {"alfworld": job_spec}, job_id)
    job_id = handles["alfworld"].id
    assert [m.step for m in metrics["alfworld"] if m.split == "train"] == [0, 1]
    await log_rows(data_dir, f"SELECT count(*) FROM trajectories WHERE job_id = '{job_id}' AND split = 'train'", 8)
    eps = episodes(data_dir, job_id, "split = 'train'")
    assert len(eps) == 8 and not any(ep["error"] for ep in eps), [ep["error"] for ep in eps]
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for ep in eps:
        check_episode(ep)
        info = json.loads(ep["env_info"])
        assert info["game"].startswith("json_2.1.1/train/") and info["game"].endswith("/game.tw-pddl")
        prompt = tok.decode(ep["token_ids"][:ep["prompt_len"]])
        assert WELCOME in prompt and "Your task is to: " in prompt and "Admissible commands: go to " in prompt
        # ALFWorld's reward: 1.0 only on a won turn, and a won turn ends the episode
        assert all(t["reward"] in (0.0, 1.0) for t in ep["turns"])
        assert ep["reward"] == (1.0 if info["won"] else 0.0)
        assert len(ep["turns"]) == info["turn"] <= 3
        # every turn but the last is answered by the game, and its answer is not trained on
        assert all(t["observation"] and t["obs_end"] > t["gen_end"] for t in ep["turns"][:-1])
    # the random tiny model does not win in 3 turns: the episodes run all 3
    assert all(len(ep["turns"]) == 3 for ep in eps if not json.loads(ep["env_info"])["won"])
    assert any(len(ep["turns"]) == 3 for ep in eps)
    # evaluation (split "test") plays the held-out valid_unseen games
    await log_rows(data_dir, f"SELECT count(*) FROM trajectories WHERE job_id = '{job_id}' AND split <> 'train'", 2)
    evals = episodes(data_dir, job_id, "split <> 'train'")
    assert evals and all(json.loads(ep["env_info"])["game"].startswith("json_2.1.1/valid_unseen/") for ep in evals)
