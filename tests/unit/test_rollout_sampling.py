"""Tinker sampling on a rollout worker (services/rollout/sampling.py): completions end
at the first stop token or stop string, that token included; Tinker's `stop` field
parses to token ids or strings (services/tinker/wire.py)."""

import msgspec
import pytest

from opentinker.schemas.tinker import TinkerSample
from opentinker.services.rollout.agent_loop import GenOut
from opentinker.services.rollout.sampling import cut_at_stop
from opentinker.services.tinker import wire


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i)."""

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def req(**kw) -> TinkerSample:
    return TinkerSample(job_id="j", sampler="ts-0123456789-s0", seq_id=0, tokens=[1], **kw)


def test_a_completion_ends_at_its_first_stop():
    out = GenOut(token_ids=[0, 1, 2, 3, 4], logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5], finish_reason="length")
    plain = cut_at_stop(out, req(), Letters())
    assert (plain.tokens, plain.stop_reason) == ([0, 1, 2, 3, 4], "length")
    by_token = cut_at_stop(out, req(stop_tokens=[3, 2]), Letters())
    assert (by_token.tokens, by_token.logprobs, by_token.stop_reason) == ([0, 1, 2], [-0.1, -0.2, -0.3], "stop")
    by_text = cut_at_stop(out, req(stop_strings=["cd", "zz"]), Letters())  # "abcd" holds "cd"
    assert (by_text.tokens, by_text.stop_reason) == ([0, 1, 2, 3], "stop")
    eos = cut_at_stop(GenOut(token_ids=[0, 9], logprobs=[-1.0, -2.0], finish_reason="stop"), req(), Letters())
    assert eos.stop_reason == "stop" and eos.tokens == [0, 9]


def test_tinkers_stop_field():
    assert wire.stops(None) == ([], [])
    assert wire.stops("\n") == ([], ["\n"])
    assert wire.stops([5, 7]) == ([5, 7], [])
    assert wire.stops(["a", "bc"]) == ([], ["a", "bc"])
    for bad, match in (([], "not served"), ([1, "a"], "a string"), ([-1], "a string"), ({"x": 1}, "a string")):
        with pytest.raises(wire.WireError, match=match):
            wire.stops(bad)


class CountingLetters(Letters):
    def __init__(self):
        self.decoded = 0  # tokens decoded in all

    def decode(self, ids):
        self.decoded += len(ids)
        return super().decode(ids)


def test_stop_strings_cost_a_few_decodes_whatever_their_number():
    """Issue 30, item 7: matching re-decoded the whole prefix per stop string per token
    (1,024 tokens x 16 strings: ~8.4M tokens decoded, inside the engine's lock)."""
    n = 1024
    ids = [i % 20 for i in range(n - 1)] + [25]  # "z" only at the very end
    out = GenOut(token_ids=ids, logprobs=[-1.0] * n, finish_reason="length")
    strings = [f"q{c}" for c in "abcdefghijklmno"] + ["z"]  # 16, one matching at the end
    tok = CountingLetters()
    got = cut_at_stop(out, req(stop_strings=strings), tok)
    assert (len(got.tokens), got.stop_reason) == (n, "stop")
    assert tok.decoded <= 12 * n, tok.decoded  # 1 + log2(1024) decodes of at most n tokens
    tok = CountingLetters()
    none = cut_at_stop(out, req(stop_strings=strings[:-1]), tok)
    assert (len(none.tokens), none.stop_reason, tok.decoded) == (n, "length", n)
    # the first token that completes a string, wherever it is
    for at in (1, 2, 500, 1023):
        seq = [0] * n
        seq[at - 1] = 25
        cut = cut_at_stop(GenOut(token_ids=seq, logprobs=[-1.0] * n, finish_reason="length"),
                          req(stop_strings=["z"], stop_tokens=[24]), Letters())
        assert len(cut.tokens) == at, at
    # a stop token before the string wins
    both = cut_at_stop(GenOut(token_ids=[0, 3, 25], logprobs=[-1.0] * 3, finish_reason="length"),
                       req(stop_strings=["z"], stop_tokens=[3]), Letters())
    assert both.tokens == [0, 3]


def test_stops_are_bounded_at_the_edge():
    from opentinker.schemas.tinker import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKENS

    for bad, match in ((["a"] * (MAX_STOP_STRINGS + 1), "stop strings"),
                       (["x" * (MAX_STOP_STRING_CHARS + 1)], "characters"),
                       ("x" * (MAX_STOP_STRING_CHARS + 1), "characters"),
                       (list(range(MAX_STOP_TOKENS + 1)), "stop tokens")):
        with pytest.raises(wire.WireError, match=f"sampling_params.stop: .*{match}"):
            wire.stops(bad)


def test_one_batch_of_sample_calls_is_one_engine_call_and_a_bad_one_fails_alone(tiny_model):
    """A fetched batch of a sampling session's `sample` calls ran one engine.generate per
    call; now one for the batch, each prompt with its own call's parameters, and a call
    the engine cannot take (a token outside the vocabulary, no room) fails alone."""
    from opentinker.services.rollout.engine_hf import HFEngine
    from opentinker.services.rollout.sampling import batch_key, samples_blocking

    eng = HFEngine(tiny_model, seed=3)
    calls = []
    generate = eng.generate

    def counted(prompts, sampling, *a, **kw):
        calls.append([(len(p), s.max_new_tokens, s.temperature) for p, s in zip(prompts, sampling)])
        return generate(prompts, sampling, *a, **kw)

    eng.generate = counted
    vocab = len(eng.tokenizer)
    def call(tokens, **kw):
        return TinkerSample(job_id="j", sampler="ts-0123456789-s0", seq_id=0, tokens=tokens, **kw)

    reqs = [call([5, 6, 7], num_samples=3, max_tokens=4),
            call([5, vocab + 1], num_samples=2),
            call([8], num_samples=2, max_tokens=6, temperature=0.0),
            call([9] * eng.max_model_len),
            call([5, 6, 7, 8], max_tokens=2, prompt_logprobs=True)]
    got = samples_blocking(eng, reqs)
    assert len(calls) == 1 and calls[0] == [(3, 4, 1.0)] * 3 + [(1, 6, 0.0)] * 2 + [(4, 2, 1.0)], calls
    assert [type(g).__name__ for g in got] == ["tuple", "ValueError", "tuple", "ValueError", "tuple"]
    assert "out of the model's vocabulary" in str(got[1]) and "tokens (1 to" in str(got[3])
    assert [len(g[0]) for g in (got[0], got[2], got[4])] == [3, 2, 1]
    assert all(1 <= len(o.token_ids) <= 4 for o in got[0][0]) and all(len(o.token_ids) <= 2 for o in got[4][0])
    assert got[2][0][0].token_ids == got[2][0][1].token_ids  # temperature 0: greedy, both alike
    assert got[0][1] == [] and len(got[4][1]) == 4 and got[4][2] == {}
    # one user's session on one set of weights per batch: another sampler is another batch
    other = TinkerSample(job_id="j", sampler="ts-0123456789-s1", seq_id=0, tokens=[1])
    assert batch_key(reqs[0]) == batch_key(reqs[4]) != batch_key(other)


def test_a_seeded_sample_call_returns_the_same_completions_in_any_batch(tiny_model):
    """Tinker's `sampling_params.seed`: completion i of a seeded call samples with
    derived_seed("tinker", seed, i), so the call returns the same completions alone or
    batched with other calls; its num_samples completions differ from each other, and
    another seed draws others."""
    from opentinker.schemas.stats import derived_seed
    from opentinker.services.rollout.engine_hf import HFEngine
    from opentinker.services.rollout.sampling import sample_seeds, samples_blocking

    eng = HFEngine(tiny_model, seed=3)

    def call(seed, tokens=(5, 6, 7), **kw):
        return TinkerSample(job_id="j", sampler="ts-0123456789-s0", seq_id=0, tokens=list(tokens),
                            num_samples=3, max_tokens=8, seed=seed, **kw)

    assert sample_seeds(call(42)) == [derived_seed("tinker", 42, i) for i in range(3)]
    assert sample_seeds(call(None)) == [None] * 3

    def ids(got):
        return [o.token_ids for o in got[0]]

    [alone] = samples_blocking(eng, [call(42)])
    unseeded, seeded, _ = samples_blocking(eng, [call(None, (9, 9)), call(42), call(7, (4,))])
    assert ids(seeded) == ids(alone) and len({tuple(x) for x in ids(alone)}) == 3
    [other] = samples_blocking(eng, [call(43)])
    assert ids(other) != ids(alone)
    assert TinkerSample(job_id="j", sampler="s", seq_id=0, tokens=[1]).seed is None


def test_top_k_sample_logprobs_are_the_raw_distributions_at_each_kept_token(tiny_model):
    """Tinker's topk_sample_logprobs: at each sampled position the k most likely tokens
    of the raw distribution, from one pass over prompt + completion, cut with the
    completion at its stop. Greedy samples are each row's most likely token."""
    import numpy as np

    from opentinker.services.rollout.engine_hf import HFEngine
    from opentinker.services.rollout.sampling import cut_at_stop, samples_blocking, with_topk

    eng = HFEngine(tiny_model, seed=3)
    prompt = [5, 6, 7]
    greedy = TinkerSample(job_id="j", sampler="ts-0123456789-s0", seq_id=0, tokens=prompt, num_samples=2,
                          max_tokens=6, temperature=0.0, topk_sample_logprobs=3)
    plain = TinkerSample(job_id="j", sampler="ts-0123456789-s0", seq_id=1, tokens=prompt, max_tokens=6)
    full = TinkerSample(job_id="j", sampler="ts-0123456789-s0", seq_id=2, tokens=[9] * (eng.max_model_len - 1),
                        topk_sample_logprobs=2)
    (outs, _, _, topk), (_, _, _, none), refused = samples_blocking(eng, [greedy, plain, full])
    assert none == [None] and isinstance(refused, ValueError) and "tokens (1 to" in str(refused)
    for o, (ids, lps) in zip(outs, topk):
        n = len(o.token_ids)
        assert ids.shape == lps.shape == (n, 3) and ids.dtype == np.int32 and lps.dtype == np.float32
        assert ids[:, 0].tolist() == o.token_ids  # greedy: the most likely token each time
        assert (np.diff(lps, axis=1) <= 0).all() and (lps <= 0).all()
        # the raw logprob of each sampled token, scored apart
        scored = eng.prompt_logprobs([prompt + o.token_ids])[0][len(prompt):]
        assert np.allclose(lps[:, 0], scored, atol=1e-4), (lps[:, 0], scored)
    # a stop cuts the rows with the tokens
    o = outs[0]
    cut = cut_at_stop(o, msgspec.structs.replace(greedy, stop_tokens=[o.token_ids[1]]), eng.tokenizer)
    seq = with_topk(cut, topk[0])
    assert len(seq.tokens) <= 2 and seq.topk_k == 3
    assert np.frombuffer(seq.topk_ids, "<i4").reshape(-1, 3).tolist() == topk[0][0][:len(seq.tokens)].tolist()
    assert with_topk(cut, None) is cut
