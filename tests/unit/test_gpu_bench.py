"""bench/gpu_bench.py on a CPU at the tests' tiny shape: every part it times does the
same work on both sides (the same tokens made, the same weights moved), and its
135M shape is SmolLM2-135M's own."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def G():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("gpu_bench")


def test_the_135m_shape_is_smollm2s_config(G, smollm2):
    cfg = json.loads((Path(smollm2) / "config.json").read_text())
    shape = G.SHAPES["135m"]
    assert {k: cfg[k] for k in shape if k in cfg} == {k: v for k, v in shape.items() if k in cfg}
    assert shape["rope_theta"] == cfg["rope_parameters"]["rope_theta"]


def test_generation_makes_the_same_tokens_on_every_side_and_a_lora_version_moves_the_engine(G, smollm2, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setattr(G, "ROWS", 8)  # 8 x 8 tokens: the bench's 32 x 32 cost ~15 s here
    monkeypatch.setattr(G, "NEW_TOKENS", 8)
    model = G.make_model("tiny", smollm2, tmp_path / "tiny")
    assert G.make_model("tiny", smollm2, tmp_path / "tiny") == model  # made once
    gen = G.bench_gen(model, "cpu", 1, ["dynamic", "static"])
    assert set(gen["systems"]) == {"transformers_generate", "transformers_generate_static", "opentinker_dynamic",
                                   "opentinker_static", "opentinker_dynamic_unseeded", "opentinker_static_unseeded"}
    assert {v["tokens"] for v in gen["systems"].values()} == {G.ROWS * G.NEW_TOKENS}
    assert gen["ratio_ours_best_vs_library_best"] > 0
    sync = G.bench_sync(model, "cpu", 1, ["lora"])
    lora = sync["lora"]
    assert lora["tensors"] == 4 and 0 < lora["bytes"] < 200_000  # the adapter of q/v on 2 layers, not the model
    assert lora["total_s"] >= lora["publish_s"] + lora["load_s"]
    res = {"device": "cpu", "commit": "0" * 40, "date": "2026-11-29 01:00",
           "parts": {"gen": {"size": "tiny", **gen}, "sync": {"size": "tiny", **sync},
                     "e2e": {"skipped": "missing here: trl"}}}
    text = G.summary(res)
    assert "ours/library best" in text and "sync lora (tiny)" in text and "missing here: trl" in text
    table = G.report(res)  # bench/RESULTS.md's rows: each number beside its target
    assert "| weight sync, lora (tiny) |" in table and "<= 1.5x" in table and "| e2e | missing here: trl |" in table
