"""Tinker sampling on a rollout worker (services/rollout/sampling.py): completions end
at the first stop token or stop string, that token included; Tinker's `stop` field
parses to token ids or strings (services/tinker/wire.py)."""

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
