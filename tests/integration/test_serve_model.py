"""`opentinker serve-model`: the vLLM command it plans (--dry-run) for a base model, an
adapter folder and a job's final checkpoint; its refusals; and one real server on the
tiny model with a LoRA adapter, checked over HTTP as an OpenAI client would."""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def serve_model(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "OPENTINKER_SERVE_API_KEY"}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "opentinker.cli", "serve-model", *args],
                          env=e, capture_output=True, text=True, timeout=120, check=False)


def dry_run(*args: str, env: dict[str, str] | None = None) -> dict[str, list[str]]:
    """The dry-run's lines as {"command": argv, "env": names, "names": served names}."""
    r = serve_model("--dry-run", *args, env=env)
    assert r.returncode == 0, r.stderr
    out = {}
    for line in r.stdout.splitlines():
        key, _, rest = line.partition(": ")
        if key in ("command", "env", "names"):
            out[key] = shlex.split(rest) if key == "command" else rest.split()
    return out


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory) -> Path:
    """A saved peft LoRA adapter folder (q/v, r=8) for the tiny model, lora_B non-zero."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    out = tmp_path_factory.mktemp("adapters") / "tuned-adapter"
    peft.save_pretrained(out)
    return out


# -- dry runs ---------------------------------------------------------------------------


def test_dry_run_base(tiny_model):
    out = dry_run("--model", tiny_model, "--port", "8123")
    cmd = out["command"]
    assert cmd[1:5] == ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model", tiny_model]
    assert flag(cmd, "--port") == "8123" and flag(cmd, "--host") == "127.0.0.1"
    assert flag(cmd, "--dtype") == "float32" and flag(cmd, "--max-model-len") == "2048"
    assert flag(cmd, "--served-model-name") == "tiny-llama"
    assert "--enable-lora" not in cmd
    assert out["names"] == ["tiny-llama"]
    assert "VLLM_API_KEY" not in out["env"]


def test_dry_run_adapter_takes_base_from_adapter_and_key_from_env(tiny_model, adapter):
    key = secrets.token_hex(16)
    r = serve_model("--dry-run", "--adapter", str(adapter), "--host", "0.0.0.0", "--", "--seed", "3",
                    env={"OPENTINKER_SERVE_API_KEY": key})
    assert r.returncode == 0, r.stderr
    assert key not in r.stdout + r.stderr
    out = {k: v for k, _, v in (line.partition(": ") for line in r.stdout.splitlines())}
    cmd = shlex.split(out["command"])
    assert cmd[4] == tiny_model  # base_model_name_or_path from adapter_config.json
    assert flag(cmd, "--lora-modules") == f"tuned-adapter={adapter}"
    assert flag(cmd, "--max-lora-rank") == "8" and "--enable-lora" in cmd
    assert cmd[-2:] == ["--seed", "3"]
    assert out["names"].split() == ["tiny-llama", "tuned-adapter"]
    assert "VLLM_API_KEY" in out["env"]


def test_dry_run_job_adapter_and_full_checkpoint(tiny_model, adapter, tmp_path):
    home = tmp_path / "home"
    lora_job, full_job = "t-serve-lora", "t-serve-full"
    shutil.copytree(adapter, home / "checkpoints" / lora_job / "final")
    full = home / "checkpoints" / full_job / "final"
    full.mkdir(parents=True)
    shutil.copy(Path(tiny_model) / "config.json", full / "config.json")
    env = {"OPENTINKER_HOME": str(home)}

    out = dry_run("--model", tiny_model, "--job", lora_job, env=env)
    assert out["names"] == ["tiny-llama", lora_job]
    assert (flag(out["command"], "--lora-modules")
            == f"{lora_job}={(home / 'checkpoints' / lora_job / 'final').resolve()}")

    out = dry_run("--job", full_job, env=env)
    assert out["names"] == [full_job]
    assert out["command"][4] == str(full.resolve())
    assert "--enable-lora" not in out["command"]
    assert flag(out["command"], "--served-model-name") == full_job


def test_refusals(tiny_model, tmp_path):
    r = serve_model("--dry-run", "--model", tiny_model, "--host", "0.0.0.0")
    assert r.returncode == 2 and "--host 0.0.0.0" in r.stderr and "OPENTINKER_SERVE_API_KEY" in r.stderr

    r = serve_model("--dry-run", "--model", tiny_model, "--adapter", str(tmp_path / "missing"))
    assert r.returncode == 2 and "--adapter" in r.stderr and "no such folder" in r.stderr

    r = serve_model("--dry-run", "--model", tiny_model, "--adapter", tiny_model)  # a model, not an adapter
    assert r.returncode == 2 and "not a LoRA adapter" in r.stderr

    r = serve_model("--dry-run", "--model", tiny_model, "--job", "t-no-such-job",
                    env={"OPENTINKER_HOME": str(tmp_path)})
    assert r.returncode == 2 and "--job t-no-such-job" in r.stderr and "no final checkpoint" in r.stderr

    r = serve_model("--dry-run", "--model", tiny_model, "--", "--api-key", "x")
    assert r.returncode == 2 and "OPENTINKER_SERVE_API_KEY" in r.stderr


# -- a real server ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_cmdlines(pid: int) -> list[str]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return out


@pytest.mark.timeout(300)
def test_serves_base_and_adapter_with_key(home, tiny_model, adapter, tmp_path):
    key, port = secrets.token_hex(16), free_port()
    log_path = tmp_path / "serve-model.log"
    env = dict(os.environ, OPENTINKER_HOME=str(home), OPENTINKER_SERVE_API_KEY=key,
               VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "opentinker.cli", "serve-model", "--model", tiny_model,
           "--adapter", str(adapter), "--served-name", "tuned", "--port", str(port), "--max-model-len", "512"]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"serve-model exited {proc.returncode}\n{log_path.read_text()[-4000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(1)

        assert all(key not in c for c in children_cmdlines(proc.pid)), "the key is on a command line"
        auth = {"Authorization": f"Bearer {key}"}
        models = httpx.get(f"{url}/v1/models", headers=auth, timeout=10).json()
        assert {m["id"] for m in models["data"]} == {"tiny-llama", "tuned"}

        for name in ("tiny-llama", "tuned"):
            r = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=60, json={
                "model": name, "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == name and body["usage"]["completion_tokens"] > 0

        # the adapter is applied: same prompt, different next-token distribution
        tops = []
        for name in ("tiny-llama", "tuned"):
            r = httpx.post(f"{url}/v1/completions", headers=auth, timeout=60, json={
                "model": name, "prompt": "hello world", "max_tokens": 1, "temperature": 0, "logprobs": 3})
            tops.append(r.json()["choices"][0]["logprobs"]["top_logprobs"][0])
        assert tops[0] != tops[1]

        bad = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert bad.status_code == 401
        r = httpx.post(f"{url}/v1/chat/completions", timeout=10, json={
            "model": "tuned", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 401
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # serve-model forwards it to vLLM's group
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log_path.read_text()[-4000:]
