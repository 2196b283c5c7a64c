"""Upstream OpenTinker's workflow on the shared stack of tests/tenants.py (the `world`
fixture), as user alice with only her key and the REST URL: SchedulerClient reserves,
GameEnvironment serves a game from this process, ServiceClient.fit trains on it,
InferenceSchedulerClient serves the policy and run_inference plays the game through it."""

import asyncio
import json
import re

import pytest

from opentinker.client.utils.http_training_client import InferenceSchedulerClient, SchedulerClient, ServiceClient
from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.environment.base_game_environment import GameEnvironment
from opentinker.environment.inference_pipeline import run_inference

pytestmark = pytest.mark.timeout(900)


class AddGame(AbstractGame):
    def __init__(self, offset: int = 0):
        self.offset = offset

    def generate_initial_state(self, seed: int, split: str = "train") -> dict:
        return {"a": seed % 10, "b": (seed // 10) % 10}

    def reset(self, a: int = 0, b: int = 0, **_) -> str:
        self.answer = a + b + self.offset
        return f"{a} + {b}"

    def step(self, action: str) -> StepResult:
        m = re.search(r"-?\d+", action)
        return StepResult("", float(m is not None and int(m.group()) == self.answer), True)

    def get_system_prompt(self) -> str:
        return "Answer with just the number."

    def get_initial_user_message(self) -> str:
        return "What is"


async def test_upstream_workflow_trains_on_the_clients_game_and_serves_its_policy(world, tmp_path, monkeypatch):
    monkeypatch.setenv("NATS_URL", world.server.url)
    monkeypatch.delenv("NATS_NKEY", raising=False)
    args = {"experiment_name": "seed-e2e", "tokenizer_path": world.tiny_model, "batch_size": 2, "rollout_n": 2,
            "num_steps": 2, "save_freq": 100, "test_freq": 0, "temperature": 1.0, "top_p": 1.0,
            "max_new_tokens": 8, "max_prompt_tokens": 200, "adv_estimator": "grpo",
            "lora": {"lora_rank": 4, "lora_alpha": 8, "lr": 1e-3}, "num_gpus": 8,
            "interaction": {"name": "seed-add"}, "job_spec": {"engine": "hf", "micro_batch_size": 4}}
    out = tmp_path / "results.jsonl"

    def workflow():
        scheduler = SchedulerClient(scheduler_url=world.api_url, api_key=world.alice_key)
        res = scheduler.submit_job(config=args, num_gpus=8)
        env = GameEnvironment(game_class=AddGame, config=args, game_kwargs={"offset": 0}, job_id=res["job_id"])
        client = ServiceClient(server_url=res["server_url"])
        client.set_config(args, env)
        metrics = client.fit(env=env, num_steps=2, test_freq=0, verbose=False)
        status = scheduler.get_job_status(res["job_id"])
        inf = InferenceSchedulerClient(scheduler_url=world.api_url, api_key=world.alice_key)
        got = inf.submit_inference_job(model_path=res["job_id"])
        results = run_inference(game_class=AddGame, job_id=got["job_id"], vllm_server_url=got["vllm_server_url"],
                                output_path=str(out), max_samples=3, max_tokens=8)
        ended = inf.complete_job(got["job_id"])
        return res, env, metrics, status, got, results, ended

    res, env, metrics, status, got, results, ended = await asyncio.to_thread(workflow)
    assert metrics["step"] == 1 and "reward_mean" in metrics, metrics
    assert status["status"] == "COMPLETED" and not env.serving
    assert got["vllm_server_url"].endswith(f"/jobs/{got['job_id']}/v1") and got["api_key"]
    assert len(results) == 3 and len(out.read_text().splitlines()) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["messages"][1]["content"].startswith("What is") for r in rows)
    assert ended["status"] == "COMPLETED"  # the endpoint job ended as done (POST /complete)
