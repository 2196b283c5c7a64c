"""The learner's engine data parallel on CPU: 2 ranks (torchrun, gloo), each training
on its shard of the micro-batches, give the loss, gradient norm and weights of 1 rank on
the same batch: ZeRO off, at stage 2 (optimizer state and gradients partitioned) and at
stage 3 (parameters too)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from opentinker.services.core.nats_server import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "ranks" / "engine_step.py"


def run_ranks(n: int, model: str, out: Path, zero_stage: int) -> tuple[dict, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    got = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
                          "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(SCRIPT), model, str(out),
                          str(zero_stage)], capture_output=True, text=True, env=env, timeout=400)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-8000:]
    return json.loads((out / "metrics.json").read_text()), load((out / "weights.safetensors").read_bytes())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, tiny_model):
    return run_ranks(1, tiny_model, tmp_path_factory.mktemp("one-rank"), 0)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_two_ranks_train_as_one_on_the_same_batch(tmp_path, tiny_model, one_rank, zero_stage):
    one, w1 = one_rank
    two, w2 = run_ranks(2, tiny_model, tmp_path / "two", zero_stage)
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert one["micro_batches"] == [4] and two["micro_batches"] == [2]  # rank 0's share
    for s1, s2 in zip(one["steps"], two["steps"]):
        assert s2["tokens"] == s1["tokens"] > 0
        for key in ("loss", "grad_norm", "entropy", "approx_kl"):
            assert s2[key] == pytest.approx(s1[key], rel=1e-4, abs=1e-6), (key, s1, s2)
    assert one["steps"][1]["loss"] != one["steps"][0]["loss"]  # the first step moved the policy
    assert w1.keys() == w2.keys() and w1
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-6, rtol=1e-4), name
    assert any(w.abs().sum() > 0 for n, w in w1.items() if "lora_B" in n)  # B left its zero init
