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
    # top_p None (no row filters) is top_p 1 without looking at it: the same draws
    a = sample(logits, torch.ones(2000), torch.ones(2000), torch.Generator().manual_seed(1))
    b = sample(logits, torch.ones(2000), None, torch.Generator().manual_seed(1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_top_k_keeps_the_k_most_likely_tokens_and_renormalizes():
    from opentinker.services.rollout.engine_hf import sample

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [-1.0, 0.0, 3.0, 1.0]]).repeat(1000, 1)
    g = torch.Generator().manual_seed(0)
    k = torch.tensor([2, 1]).repeat(1000)
    tok, lp = sample(logits, torch.ones(2000), torch.ones(2000), g, k)
    assert set(tok[0::2].tolist()) == {0, 1} and set(tok[1::2].tolist()) == {2}
    p = logits[0].softmax(-1)
    assert torch.allclose(lp[0::2], torch.log(p[tok[0::2]] / (p[0] + p[1])), atol=1e-5)
    assert torch.allclose(lp[1::2], torch.zeros(1000), atol=1e-6)  # k = 1: the one token, logprob 0
    # k <= 0 keeps every token; top-k then top-p: k = 3 leaves 0.665 / 0.245 / 0.090, top_p 0.9 keeps two
    tok, lp = sample(logits[:2], torch.ones(2), torch.ones(2), g, torch.tensor([0, -1]))
    assert torch.allclose(lp, logits[:2].log_softmax(-1).gather(-1, tok[:, None])[:, 0], atol=1e-5)
    tok, _ = sample(logits[0::2], torch.ones(1000), torch.full((1000,), 0.9), g, torch.full((1000,), 3))
    assert set(tok.tolist()) == {0, 1}


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


def test_prompt_top_k_are_the_k_most_likely_tokens_most_likely_first_and_hold_the_prompt_logprobs(tiny_model):
    from opentinker.schemas.tinker import TOPK_MASK_LOGPROB
    from opentinker.services.rollout.engine_hf import HFEngine

    eng = HFEngine(tiny_model, seed=0)
    prompt = eng.tokenizer("The quick brown fox jumps", add_special_tokens=False)["input_ids"]
    lps, ids, top = eng.prompt_logprobs_topk(prompt, 5)
    assert lps[0] is None and lps[1:] == pytest.approx(eng.prompt_logprobs([prompt])[0][1:], abs=1e-5)
    assert ids.shape == top.shape == (len(prompt), 5) and ids.dtype.name == "int32"
    assert ids[0].tolist() == [0] * 5 and top[0].tolist() == [TOPK_MASK_LOGPROB] * 5
    with torch.no_grad():
        ref = eng.model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1).topk(5)
    assert ids[1:].tolist() == ref.indices.tolist()
    assert torch.allclose(torch.from_numpy(top[1:]), ref.values, atol=1e-5)
    assert all((top[t, :-1] >= top[t, 1:]).all() and top[t, 0] >= lps[t] - 1e-6 for t in range(1, len(prompt)))


def test_draws_from_uniforms_follow_the_filtered_distribution():
    """Inversion: row i takes the first token whose cumulative probability exceeds its
    uniform, after the same top-k / top-p filtering; a filtered token is never taken,
    not even at a draw of 0 or just under 1."""
    from opentinker.services.rollout.engine_hf import per_request_uniforms, sample

    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(n, 1)
    u = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tok, lp = sample(logits, torch.ones(n), None, uniforms=u)
    p = logits[0].softmax(-1)
    freq = torch.bincount(tok, minlength=5).double() / n
    assert torch.allclose(freq[:4], p[:4].double(), atol=0.012), (freq, p)
    assert torch.allclose(lp, logits[0].log_softmax(-1)[tok], atol=1e-5)
    # the draw is monotone in u: sorted draws give sorted tokens
    assert torch.equal(sample(logits, torch.ones(n), None, uniforms=u.sort().values)[0], tok.sort().values)
    edge = torch.tensor([0.0, 1.0 - 1e-16, 0.5], dtype=torch.float64)
    tok, _ = sample(logits[:3], torch.ones(3), torch.full((3,), 0.8), uniforms=edge)
    assert set(tok.tolist()) <= {0, 1} and tok[0] == 0 and tok[1] == 1  # top_p 0.8 keeps two
    tok, _ = sample(logits[:3], torch.ones(3), None, top_k=torch.full((3,), 1), uniforms=edge)
    assert tok.tolist() == [0, 0, 0]
    # a row's draws are its seed's stream, whatever its limit or neighbours
    a = per_request_uniforms([7, None, 9], [3, 5, 2], torch.Generator().manual_seed(0))
    b = per_request_uniforms([9, 7], [6, 1], torch.Generator().manual_seed(0))
    assert a.shape == (3, 5) and torch.equal(a[2, :2], b[0, :2]) and torch.equal(a[0, :1], b[1, :1])
    assert per_request_uniforms(None, [3], torch.Generator()) is None
    with pytest.raises(ValueError, match="1 seeds for 2 prompts"):
        per_request_uniforms([1], [3, 3], torch.Generator())


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_a_seeded_completion_does_not_depend_on_its_batch(tiny_model, decode):
    """Per-request seeds: each row draws from its own generator, so a seeded prompt's
    completion is the same alone, reversed in its batch, or beside unseeded prompts (and
    the static cache's padding rows); other seeds draw other completions."""
    from opentinker.services.rollout.engine_hf import HFEngine

    eng = HFEngine(tiny_model, seed=0, decode=decode)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    prompts = [[1, 20 + i, 30, 40] for i in range(5)]
    seeds = [11, 12, 13, 14, 15]
    first = [o.token_ids for o in eng.generate(prompts, sp, seeds=seeds)]
    alone = [o.token_ids for o in eng.generate(prompts[2:3], sp, seeds=seeds[2:3])]
    assert alone == first[2:3]
    mixed = eng.generate(prompts[::-1] + [[1, 99]] * 2, sp, seeds=seeds[::-1] + [None] * 2)
    assert [o.token_ids for o in mixed[:5]][::-1] == first
    shorter = eng.generate(prompts[2:3], SamplingParams(temperature=1.0, max_new_tokens=4), seeds=seeds[2:3])
    assert shorter[0].token_ids == first[2][:4]  # a shorter limit: the same first draws
    other = [o.token_ids for o in eng.generate(prompts, sp, seeds=[s + 100 for s in seeds])]
    assert sum(a != b for a, b in zip(other, first)) >= 4
    with pytest.raises(ValueError, match="2 seeds for 5 prompts"):
        eng.generate(prompts, sp, seeds=[1, 2])


def test_resolve_decode_and_batch_buckets():
    from opentinker.services.rollout.engine_hf import MAX_BATCH, bucket, resolve_decode

    assert resolve_decode("auto", "cuda") == resolve_decode("auto", "cuda:1") == "compiled"
    assert resolve_decode("auto", "cpu") == "dynamic" and resolve_decode("static", "cpu") == "static"
    with pytest.raises(ValueError, match="hf_decode"):
        resolve_decode("fast", "cpu")
    assert [bucket(n) for n in (1, 2, 3, 5, 32, 33, MAX_BATCH)] == [1, 2, 4, 8, 32, 64, MAX_BATCH]


@pytest.mark.parametrize("decode", ["static", "compiled"])
def test_static_and_compiled_decoding_match_the_dynamic_cache(tiny_model, decode):
    """The same greedy tokens and logprobs as the growing cache, for batches of other
    shapes through one engine (padded rows never leak), and after a weight load: the
    compiled forward reads the parameters loaded in place (compiled: ~27 s of
    inductor's compile on a 2-core CPU)."""
    from opentinker.services.rollout.engine_hf import HFEngine

    dyn, eng = HFEngine(tiny_model, seed=0), HFEngine(tiny_model, seed=0, decode=decode)
    assert eng.decode == decode
    tok = eng.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"]
               for t in ("Hello there", "A much longer prompt, with more words in it", "x")]
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    name = "model.layers.1.mlp.down_proj.weight"
    w = eng.model.get_parameter(name).detach().clone()
    before = None
    runs = [(prompts, [12, 5, 9], False), (prompts[:1], [7], False), (prompts, [6, 6, 6], True)]
    if decode == "compiled":
        del runs[1]  # one shape: one compile (~27 s here), not two
    for batch, caps, changed in runs:
        if changed:  # a new policy version: both engines load it in place
            for e in (dyn, eng):
                e.load_weights({name: w * -3.0})
        a, b = dyn.generate(batch, greedy, max_new_tokens=caps), eng.generate(batch, greedy, max_new_tokens=caps)
        assert [o.token_ids for o in b] == [o.token_ids for o in a]
        assert [len(o.token_ids) for o in b] == caps
        for x, y in zip(a, b):
            assert torch.allclose(torch.tensor(y.logprobs), torch.tensor(x.logprobs), atol=1e-4)
        before = before or a
    assert [o.token_ids for o in a] != [o.token_ids[:6] for o in before]  # the load did change the policy
    assert len(eng._caches) == len(runs) - 1  # (4 rows, 128 tokens), and (1 row, 128)


def test_lora_merges_on_the_engines_device_in_its_dtype(tiny_model):
    """base_weights is the engine's own W0, where its weights live, kept from before
    the first change; the merge is rounded once, to the engine's dtype."""
    from conftest import make_lora

    from opentinker.services.rollout.engine_hf import HFEngine
    from opentinker.services.rollout.weights import lora_pairs, lora_scale, merge_lora

    eng = HFEngine(tiny_model, dtype="bfloat16")
    name = "model.layers.0.self_attn.q_proj.weight"
    w0 = eng.base_weights[name]
    assert w0.device == eng.device and w0.dtype == torch.bfloat16
    assert w0.data_ptr() != eng.model.get_parameter(name).data_ptr()  # a copy, not the live parameter
    sd, _ = make_lora(tiny_model, r=4, alpha=8, std=0.05, seed=0)
    pairs = lora_pairs(sd)
    merged = merge_lora(eng.base_weights, pairs, lora_scale(8, 4, pairs), eng.merge_dtype)
    assert merged[name].dtype == torch.bfloat16 and merged[name].device == eng.device
    eng.load_weights(merged)
    a, b = pairs[name]
    expect = (w0.float() + 2.0 * (b.float() @ a.float())).to(torch.bfloat16)
    assert torch.equal(eng.model.get_parameter(name), expect)
    assert torch.equal(eng.base_weights[name], w0)  # W0 survives the load: the next merge starts from it
    assert torch.equal(merge_lora(eng.base_weights, pairs, 2.0, eng.merge_dtype)[name], expect)


def test_a_decode_step_the_compile_cannot_take_falls_back_to_the_static_cache(tiny_model, monkeypatch, caplog):
    from opentinker.services.rollout.engine_hf import HFEngine

    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("inductor: no backend for this op")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    dyn, eng = HFEngine(tiny_model), HFEngine(tiny_model, decode="compiled")
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    with caplog.at_level("WARNING", logger="opentinker.rollout"):
        out = eng.generate([[5, 6, 7], [8, 9]], greedy)
    assert [o.token_ids for o in out] == [o.token_ids for o in dyn.generate([[5, 6, 7], [8, 9]], greedy)]
    assert eng.decode == "static" and "decoding without it" in caplog.text
