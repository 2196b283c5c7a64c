"""The client-only install (docs/install.md, `pip install opentinker` with no extra):
the base distribution goes into a fresh virtual environment, and a user there submits
a job with an API key, follows its metrics live and reads its history over REST,
against the shared multi-tenant stack (tests/tenants.py). Nothing of the `server` extra
is installed there, so any import of it fails the run."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nats

from opentinker.schemas import EnvInfoReply, EnvInfoRequest
from opentinker.schemas import subjects as S
from opentinker.sdk import Client

from tenants import make_user

ROOT = Path(__file__).resolve().parents[2]

USER_PATH = r'''
import asyncio, importlib.util, json, os, sys

import opentinker.sdk
from opentinker.sdk import Client
from opentinker.schemas import Metrics

SERVER_ONLY = ("torch", "vllm", "transformers", "deepspeed", "peft", "duckdb", "pyarrow",
               "argon2", "fastapi", "uvicorn", "numpy")


async def main() -> dict:
    spec = json.loads(os.environ["SPEC"])
    c = await Client.connect(os.environ["NATS_URL"], api_url=os.environ["OPENTINKER_API_URL"])
    try:
        assert c.is_user, "connected as a service, not as the key's user"
        job = await c.submit(spec)
        live = [m.step async for m in job.metrics() if m.split == "train"]
        rec = await job.wait(timeout_s=600)
        history = await c.reader.history(job.id, "metrics", Metrics)
        mine = [r.job_id for r in await c.jobs()]
        return {"job": job.id, "state": rec.state.value, "step": rec.step, "live_steps": live,
                "history_steps": [m.step for m in history if m.split == "train"],
                "reward_mean": [round(m.values["reward_mean"], 3) for m in history if m.split == "train"],
                "listed": job.id in mine}
    finally:
        await c.close()


out = asyncio.run(main())
out["installed_server_only"] = [m for m in SERVER_ONLY if importlib.util.find_spec(m) is not None]
out["loaded_server_only"] = [m for m in SERVER_ONLY if m in sys.modules]
print(json.dumps(out))
'''


def _client_venv(where: Path, *extra: str) -> Path:
    """A fresh venv with the base distribution of this checkout (no extras), and the
    user's own packages `extra`."""
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    env = {**os.environ, "UV_NO_PROGRESS": "1"}  # TMPDIR: conftest.private_tmp, for uv's build locks
    venv = where / "client-venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=env)
    py = venv / "bin" / "python"
    # a copy of the source, so that the build writes nothing into the checkout
    src = where / "src"
    for name in ("pyproject.toml", "README.md"):
        src.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for name in ("sdk", "client", "environment", "cli", "ops", "schemas", "services"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([uv, "pip", "install", "-q", "--python", str(py), str(src), *extra],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return py


@pytest.mark.timeout(900)
async def test_a_client_only_install_submits_follows_and_reads_history_over_rest(world, tmp_path):
    py = await asyncio.to_thread(_client_venv, tmp_path)
    key = await make_user(world.api, "carol")
    spec = {"name": "client-only", "model": world.tiny_model, "env": "arith", "engine": "hf", "steps": 3,
            "prompts_per_step": 2, "group_size": 2, "lora_rank": 4, "micro_batch_size": 4,
            "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}}
    # the key travels in the environment, never on a command line
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "NATS_URL": world.server.url,
           "OPENTINKER_API_URL": world.api_url, "OPENTINKER_API_KEY": key,
           "OPENTINKER_HOME": str(tmp_path / "home"), "SPEC": json.dumps(spec)}
    r = await asyncio.to_thread(subprocess.run, [str(py), "-c", USER_PATH], capture_output=True, text=True,
                                env=env, cwd=tmp_path, timeout=800)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(out)
    assert out["installed_server_only"] == [] and out["loaded_server_only"] == []
    assert out["state"] == "completed", out
    assert out["live_steps"] == [0, 1, 2] and out["history_steps"] == [0, 1, 2], out
    assert len(out["reward_mean"]) == 3 and out["listed"], out


SEED_WORKFLOW = r'''
import json, os, re, sys

import pyarrow as pa, pyarrow.parquet as pq

from opentinker.client.utils.http_training_client import InferenceSchedulerClient, SchedulerClient, ServiceClient
from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.environment.base_game_environment import GameEnvironment
from opentinker.environment.inference_pipeline import run_inference


class CountGame(AbstractGame):
    """Written to the seed's interface only: count the letters of a word."""

    def generate_initial_state(self):
        import random
        return {"word": random.choice(["cat", "house", "tree", "ox"])}

    def reset(self, word="cat", **kw):
        self.word = word
        return f"How many letters has {word!r}?"

    def step(self, action):
        m = re.search(r"\d+", action)
        return StepResult("", float(bool(m) and int(m.group()) == len(self.word)), True, {"word": self.word})

    def get_system_prompt(self):
        return "Reply with only the number."

    def get_initial_user_message(self):
        return "Count."


class MathGame(AbstractGame):
    """A data-dependent env as upstream's math env: the row's ground truth at reset."""

    def reset(self, ground_truth="", **kw):
        self.truth = str(ground_truth)
        return ""

    def step(self, action):
        m = re.search(r"-?\d+", action)
        ok = bool(m) and m.group() == self.truth
        return StepResult("", float(ok), True, {"correct": ok, "truth_seen_by_the_client_only": True})

    def get_system_prompt(self):
        return "Answer with the number only."

    def get_initial_user_message(self):
        return ""


def problems(path, pairs):
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "data_source": "alice-sums",
             "reward_model": {"ground_truth": str(a + b)}} for a, b in pairs]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def config(name, **kw):
    return {"experiment_name": name, "tokenizer_path": os.environ["MODEL"], "batch_size": 2, "rollout_n": 2,
            "num_steps": 3, "save_freq": 100, "test_freq": 0, "temperature": 1.0, "top_p": 1.0,
            "max_new_tokens": 8, "max_prompt_tokens": 200, "adv_estimator": "grpo", "num_gpus": 1,
            "lora": {"lora_rank": 4, "lora_alpha": 8, "lr": 1e-3}, "interaction": {"name": name},
            "job_spec": {"engine": "hf", "micro_batch_size": 4}, **kw}


url = os.environ["OPENTINKER_API_URL"]
out = {}
train = problems("train.parquet", [(a, b) for a in range(4) for b in range(3)])
val = problems("val.parquet", [(7, 1), (8, 1), (6, 2)])
for name, game, cfg in (("count", CountGame, config("count")),
                        ("sums", MathGame, config("sums", data_path=train, val_data_path=val))):
    scheduler = SchedulerClient(scheduler_url=url)
    job_result = scheduler.submit_job(config=cfg, num_gpus=1)
    job_id, server_url = job_result["job_id"], job_result["server_url"]
    env = GameEnvironment(game_class=game, config=cfg, job_id=job_id)
    client = ServiceClient(server_url=server_url)
    client.set_config(cfg, env)
    last = client.fit(env=env, num_steps=3, verbose=False)
    out[name] = {"job": job_id, "last_step": last["step"], "status": scheduler.get_job_status(job_id)["status"]}

# the trained data-dependent policy, served, plays the same env class on alice's held-out rows
inference = InferenceSchedulerClient(scheduler_url=url)
job_result = inference.submit_inference_job(model_path=out["sums"]["job"], num_gpus=1)
job_id, vllm_server_url = job_result["job_id"], job_result["vllm_server_url"]
results = run_inference(vllm_server_url=vllm_server_url, data_path=val, game_class=MathGame, job_id=job_id,
                        output_path="results.jsonl", max_tokens=8)
out["inference"] = {"job": job_id, "results": len(results), "ended": inference.complete_job(job_id)["status"],
                    "rows": [json.loads(line) for line in open("results.jsonl")]}
SERVER_ONLY = ("torch", "vllm", "transformers", "deepspeed", "peft", "duckdb", "fastapi", "uvicorn")
out["loaded_server_only"] = [m for m in SERVER_ONLY if m in sys.modules]
print(json.dumps(out))
'''


@pytest.mark.timeout(900)
async def test_a_client_only_user_runs_the_seed_workflow_on_her_own_env_and_her_own_parquet(world, tmp_path):
    """OpenTinker's client workflow as the seed writes it (SchedulerClient, GameEnvironment,
    ServiceClient.fit, InferenceSchedulerClient, run_inference), in a client-only venv
    (plus pyarrow, the user's own package for her Parquet), with only her key: her envs
    are served from her own process, her problems never leave it."""
    py = await asyncio.to_thread(_client_venv, tmp_path, "pyarrow")
    key = await make_user(world.api, "dora")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "NATS_URL": world.server.url,
           "OPENTINKER_API_URL": world.api_url, "OPENTINKER_API_KEY": key, "MODEL": world.tiny_model,
           "OPENTINKER_HOME": str(tmp_path / "home")}
    r = await asyncio.to_thread(subprocess.run, [str(py), "-c", SEED_WORKFLOW], capture_output=True, text=True,
                                env=env, cwd=tmp_path, timeout=800)
    assert r.returncode == 0, r.stderr[-4000:] + world.services.logs()
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["loaded_server_only"] == [], out
    for name in ("count", "sums"):
        assert out[name]["status"] == "COMPLETED" and out[name]["last_step"] == 2, out
        rec = await world.service.job_record(out[name]["job"])
        assert rec[0].user == "dora" and rec[0].env_owner == "dora" and rec[0].spec.env == name
    inf = out["inference"]
    assert inf["results"] == 3 and inf["ended"] == "COMPLETED" and len(inf["rows"]) == 3, inf
    assert sorted(r["ground_truth"] for r in inf["rows"]) == ["8", "8", "9"], inf["rows"]
    assert all(r["messages"][-1]["role"] == "assistant" for r in inf["rows"]), inf["rows"][0]
    # and `opentinker envhost` from the same client-only install, with only her key,
    # serves a class of hers to a job of hers
    games = ROOT / "tests" / "fixtures" / "tenant_games.py"
    host = subprocess.Popen([str(py.parent / "opentinker"), "envhost", "--env", f"{games}:SumGame", "--name", "clisum"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        job = None
        for _ in range(300):
            try:
                job = await world.service.request(S.env_info("clisum", "dora"), EnvInfoRequest(env="clisum"),
                                                  EnvInfoReply, timeout_s=2)
                break
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                assert host.poll() is None, host.stdout.read().decode()[-3000:]
                await asyncio.sleep(0.2)
        assert job is not None, "her envhost never served"
        async with await Client.connect(world.server.url, api_key=key, api_url=world.api_url) as dora:
            handle = await dora.submit({"name": "cli-env", "model": world.tiny_model, "env": "clisum", "engine": "hf",
                                        "steps": 3, "prompts_per_step": 2, "group_size": 2, "lora_rank": 4,
                                        "micro_batch_size": 4,
                                        "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}})
            rec = await handle.wait(timeout_s=600, raise_on_failure=False)
        assert rec.state.value == "completed" and rec.env_owner == "dora" and rec.step >= 2, rec
    finally:
        host.terminate()
        host.wait(20)
    # her rows were read in her own process: every reward came from her MathGame there
    from opentinker.schemas import Trajectory
    trajs = await world.service.read_subject(S.job(out["sums"]["job"], "traj"), Trajectory)
    assert trajs and all(t.env_info.get("truth_seen_by_the_client_only") for t in trajs if not t.error)
