"""The transformers engine: sampled logprobs are the processed distribution's, batches
with left padding give the same logprobs as a plain forward pass."""

import math

import pytest
import torch

from opentinker.schemas import SamplingParams


def test_top_p_keeps_the_nucleus_and_renormalizes():
    from opentinker.services.rollout.engine_hf import sample

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 2000)
    p = logits[0].softmax(-1)
    g = torch.Generator().manual_seed(0)
    tok, lp = sample(logits, torch.ones(2000), torch.full((2000,), 0.8), g)
    assert set(tok.tolist()) == {0, 1}  # p0 = 0.64 < 0.8 <= p0 + p1
    kept = p[0] + p[1]
    expect = torch.log(p[tok] / kept)
    assert torch.allclose(lp, expect, atol=1e-5)
    tok, lp = sample(logits[:3], torch.zeros(3), torch.ones(3), g)
    assert tok.tolist() == [0, 0, 0]  # temperature 0 is greedy
    tok, lp = sample(logits[:2000], torch.full((2000,), 2.0), torch.ones(2000), g)
    assert torch.allclose(lp, (logits[0] / 2).log_softmax(-1)[tok], atol=1e-5)


def test_batched_generation_logprobs_match_a_forward_pass(tiny_model):
    from opentinker.services.rollout.engine_hf import HFEngine

    eng = HFEngine(tiny_model, seed=0)
    tok = eng.tokenizer
    texts = ("Hello there", "A much longer prompt, with more words in it")
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    temp = 0.7
    outs = eng.generate(prompts, SamplingParams(temperature=temp, max_new_tokens=12), max_new_tokens=[12, 5])
    assert [len(o.token_ids) for o in outs] == [12, 5] and {o.finish_reason for o in outs} == {"length"}
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p + o.token_ids])
            logits = eng.model(ids).logits[0, len(p) - 1:-1] / temp
            ref = logits.log_softmax(-1).gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(o.logprobs), ref, atol=1e-4)


def test_load_weights_in_place_by_hf_name(tiny_model):
    from opentinker.services.rollout.engine_hf import HFEngine

    eng = HFEngine(tiny_model)
    name = "model.layers.0.self_attn.q_proj.weight"
    w = eng.model.get_parameter(name).detach().clone()
    eng.load_weights({name: w + 1.0})
    assert torch.equal(eng.model.get_parameter(name), w + 1.0)
    with pytest.raises(ValueError, match="no parameter"):
        eng.load_weights({"model.nope.weight": w})
    assert math.isfinite(eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].logprobs[0])
