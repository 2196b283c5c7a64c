"""The agent loop with the real transformers engine on the tiny model and an
in-process env: token-exact trajectories, masks, logprobs, limits and env failures."""

from __future__ import annotations

import pytest

from opentinker.schemas import (
    EnvInitReply,
    EnvResetReply,
    EnvStepReply,
    RolloutRequest,
    SamplingParams,
)
from opentinker.services.rollout.agent_loop import AgentLoop, EnvError
from opentinker.services.rollout.chat import ChatRenderer

SYSTEM = "You count sheep."
USER = "Say a number."


class CountingGame:
    """Three turns; reward 0.25 per turn; observation names the turn."""

    def __init__(self, turns: int = 3, fail_step_of: str = "", drop_step_of: str = "",
                 fail_init: bool = False):
        self.turns = turns
        self.fail_step_of = fail_step_of
        self.drop_step_of = drop_step_of
        self.fail_init = fail_init
        self.steps: dict[str, int] = {}
        self.actions: dict[str, list[str]] = {}
        self.closed: list[str] = []

    async def init(self, req):
        if self.fail_init:
            return EnvInitReply(error="no such dataset")
        return EnvInitReply(state={"start": req.seed})

    async def reset(self, req):
        self.steps[req.episode_id] = 0
        return EnvResetReply(host_id="h1", system_prompt=SYSTEM, user_message=USER)

    async def step(self, host_id, req):
        eid = req.episode_id
        if eid == self.drop_step_of:
            raise EnvError("no reply within 1 s")
        if eid == self.fail_step_of:
            return EnvStepReply(error="ZeroDivisionError: boom", done=True)
        self.steps[eid] += 1
        self.actions.setdefault(eid, []).append(req.action)
        n = self.steps[eid]
        return EnvStepReply(observation=f"Turn {n} done.", reward=0.25, done=n >= self.turns,
                            info={"turn": n})

    async def close(self, host_id, req):
        self.closed.append(req.episode_id)


class Recording:
    """Wraps an engine and keeps every prompt it was fed and every completion."""

    def __init__(self, engine):
        self.inner = engine
        self.name = engine.name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.calls: list[tuple[list[list[int]], list]] = []
        self.seeds: list[list[int]] = []  # per call, the seed of each prompt

    def generate(self, prompts, sampling, max_new_tokens=None, seeds=None):
        outs = self.inner.generate(prompts, sampling, max_new_tokens, seeds=seeds)
        self.calls.append(([list(p) for p in prompts], outs))
        self.seeds.append(list(seeds or []))
        return outs


@pytest.fixture(scope="module")
def engine(tiny_model):
    from opentinker.services.rollout.engine_hf import HFEngine

    return Recording(HFEngine(tiny_model, seed=1))


def request(**kw) -> RolloutRequest:
    sampling = kw.pop("sampling", SamplingParams(max_new_tokens=6, max_turns=3, max_total_tokens=512))
    return RolloutRequest(job_id="j1", request_id=kw.pop("request_id", "r1"), step=0, group_index=0,
                          group_seed=kw.pop("group_seed", 7), policy_version=0, model="tiny", env="count",
                          group_size=kw.pop("group_size", 2), sampling=sampling, **kw)


async def version0() -> int:
    return 0


def chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


async def test_multi_turn_trajectory_is_token_exact(engine):
    engine.calls.clear()
    game = CountingGame()
    done: list = []

    async def on_done(req, trajs):
        done.append((req.request_id, [t.episode_id for t in trajs]))

    [trajs] = await AgentLoop(engine, game, worker="w0").run([request()], version0, on_done)
    assert done == [("r1", ["r1-e0", "r1-e1"])]
    completions = [o for _, outs in engine.calls for o in outs]
    fed = [p for prompts, _ in engine.calls for p in prompts]
    tok = engine.tokenizer
    for t in trajs:
        assert not t.error and len(t.turns) == 3 and t.reward == pytest.approx(0.75)
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
        # the prompt is the chat template of system + user
        prompt = chat_ids(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
        assert t.token_ids[:t.prompt_len] == prompt
        policy = set()
        for turn in t.turns:
            gen = t.token_ids[turn.gen_start:turn.gen_end]
            # exactly what the engine returned for a prompt that is this trajectory's prefix
            match = [o for p, o in zip(fed, completions)
                     if p == t.token_ids[:turn.gen_start] and o.token_ids == gen]
            assert match, "generated ids differ from the engine's output"
            assert t.logprobs[turn.gen_start:turn.gen_end] == match[0].logprobs
            policy.update(range(turn.gen_start, turn.gen_end))
            assert turn.action == tok.decode(gen, skip_special_tokens=True)
        assert [i for i, m in enumerate(t.loss_mask) if m] == sorted(policy)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if not m)
        assert all(lp <= 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m)
        # observations are masked out and are the chat template's next user turn
        for n, turn in enumerate(t.turns[:-1], start=1):
            obs = tok.decode(t.token_ids[turn.gen_end:turn.obs_end], skip_special_tokens=False)
            closing = "\n" if turn.finish_reason == "stop" else "<|im_end|>\n"
            assert obs == f"{closing}<|im_start|>user\nTurn {n} done.<|im_end|>\n<|im_start|>assistant\n"
            assert set(t.loss_mask[turn.gen_end:turn.obs_end]) == {0}
        last = t.turns[-1]
        assert last.obs_end == last.gen_end == len(t.token_ids)
        assert t.env_info == {"turn": 3} and t.engine == "hf" and t.worker == "w0"
        assert game.actions[t.episode_id] == [turn.action for turn in t.turns]
    assert game.closed == []  # the env said done: nothing to close


async def test_a_groups_seed_fixes_its_samples(engine):
    """Each reply samples with sample_seed(group seed, the episode's place in its group,
    turn): the same group seed under another request id (a rerun of the job, a
    redelivered request) draws the same episodes, token for token; another group seed
    draws others, and the episodes of a group differ from each other."""
    from opentinker.services.rollout.agent_loop import sample_seed

    engine.seeds.clear()
    [a] = await AgentLoop(engine, CountingGame()).run([request(request_id="ra", group_size=3)], version0)
    assert engine.seeds[0] == [sample_seed(7, f"ra-e{i}", "ra", 0) for i in range(3)]
    assert engine.seeds[1] == [sample_seed(7, f"ra-e{i}", "ra", 1) for i in range(3)]
    assert sample_seed(7, "ra-e0", "ra", 1) == sample_seed(7, "rb-e0", "rb", 1) != sample_seed(7, "ra-e1", "ra", 1)
    [b] = await AgentLoop(engine, CountingGame()).run([request(request_id="rb", group_size=3)], version0)
    assert [t.token_ids for t in b] == [t.token_ids for t in a]
    assert [t.logprobs for t in b] == [t.logprobs for t in a]
    assert len({tuple(t.token_ids) for t in a}) == 3
    [c] = await AgentLoop(engine, CountingGame()).run([request(request_id="rc", group_size=3, group_seed=8)],
                                                      version0)
    assert [t.token_ids for t in c] != [t.token_ids for t in a]


async def test_turn_limit_and_token_budget_end_the_episode(engine):
    game = CountingGame(turns=10)
    short = request(request_id="r2", sampling=SamplingParams(max_new_tokens=4, max_turns=2))
    [a] = await AgentLoop(engine, game).run([short], version0)
    assert all(len(t.turns) == 2 and not t.error for t in a)
    budget = 60
    tight = request(request_id="r3", sampling=SamplingParams(max_new_tokens=8, max_turns=10,
                                                             max_total_tokens=budget))
    [b] = await AgentLoop(engine, game).run([tight], version0)
    for t in b:
        assert len(t.token_ids) <= budget and not t.error and 1 <= len(t.turns) < 10
    assert sorted(game.closed) == sorted([t.episode_id for t in a + b])


async def test_env_failures_end_episodes_with_the_reason(engine):
    game = CountingGame(fail_step_of="r4-e0", drop_step_of="r4-e1")
    [trajs] = await AgentLoop(engine, game).run([request(request_id="r4", group_size=3)], version0)
    by_id = {t.episode_id: t for t in trajs}
    assert "ZeroDivisionError: boom" in by_id["r4-e0"].error and len(by_id["r4-e0"].turns) == 1
    assert "no reply" in by_id["r4-e1"].error and len(by_id["r4-e1"].turns) == 1
    assert not by_id["r4-e2"].error and len(by_id["r4-e2"].turns) == 3
    assert game.closed == ["r4-e1"]  # the host that failed to answer still holds it

    [failed] = await AgentLoop(engine, CountingGame(fail_init=True)).run(
        [request(request_id="r5")], version0)
    assert [t.error for t in failed] == ["env init: no such dataset"] * 2
    assert all(t.token_ids == [] and t.turns == [] for t in failed)


async def test_groups_share_engine_calls_and_record_the_policy_version(engine):
    engine.calls.clear()
    versions = iter([3, 4, 5])

    async def policy() -> int:
        return next(versions)

    reqs = [request(request_id=f"g{i}", group_size=2) for i in range(3)]
    groups = await AgentLoop(engine, CountingGame()).run(reqs, policy)
    assert [len(p) for p, _ in engine.calls] == [6, 6, 6]  # 3 groups x 2 episodes, per turn
    for g in groups:
        for t in g:
            assert [turn.policy_version for turn in t.turns] == [3, 4, 5]
            assert t.policy_version == 3


def test_observation_after_a_sampled_end_of_turn(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    r = ChatRenderer(tok)
    hist = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    stopped = tok.decode(r.observation_ids(hist, "wrong", eot, "stop"))
    cut = tok.decode(r.observation_ids(hist, "wrong", 7, "length"))
    tail = "<|im_start|>user\nwrong<|im_end|>\n<|im_start|>assistant\n"
    assert stopped == "\n" + tail
    assert cut == "<|im_end|>\n" + tail


# A ChatML template that renders tools and `tool` messages the way Qwen2.5's does.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PYTHON_TOOL = {"type": "function", "function": {"name": "python", "description": "run code",
                                                "parameters": {"type": "object", "properties": {}}}}


class ToolGame(CountingGame):
    async def reset(self, req):
        self.steps[req.episode_id] = 0
        return EnvResetReply(host_id="h1", system_prompt=SYSTEM, user_message=USER, tools=[PYTHON_TOOL])


async def test_tools_rendered_by_a_template_that_defines_them(engine):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine.tokenizer.name_or_path)
    tok.chat_template = TOOL_TEMPLATE

    class WithTemplate(Recording):
        def __init__(self, inner):
            super().__init__(inner)
            self.tokenizer = tok

    eng = WithTemplate(engine.inner)
    [[t, _]] = await AgentLoop(eng, ToolGame(turns=2)).run([request()], version0)
    text = tok.decode(t.token_ids)
    assert text.startswith('<|im_start|>system\n# Tools\n<tools>{"type": "function"')
    assert "<tool_response>\nTurn 1 done.\n</tool_response>" in text
    # the observation is masked out, the policy's turns are in
    first = t.turns[0]
    assert set(t.loss_mask[first.gen_end:first.obs_end]) == {0}
    assert set(t.loss_mask[first.gen_start:first.gen_end]) == {1}


async def test_tools_ignored_by_a_template_without_them(engine):
    [[t, _]] = await AgentLoop(engine, ToolGame(turns=2)).run([request()], version0)
    text = engine.tokenizer.decode(t.token_ids)
    assert "<tools>" not in text and "<|im_start|>user\nTurn 1 done." in text
