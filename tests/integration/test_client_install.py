"""The client-only install (README "Install", `pip install opentinker` with no extra):
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


def _client_venv(where: Path) -> Path:
    """A fresh venv with the base distribution of this checkout (no extras)."""
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    venv = where / "client-venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    py = venv / "bin" / "python"
    # a copy of the source, so that the build writes nothing into the checkout
    src = where / "src"
    for name in ("pyproject.toml", "README.md"):
        src.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for name in ("sdk", "environment", "cli", "ops", "schemas", "services"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([uv, "pip", "install", "-q", "--python", str(py), str(src)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "UV_NO_PROGRESS": "1"})
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
