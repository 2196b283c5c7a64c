"""On-policy distillation: the per-token reverse-KL advantage by hand, the spec's checks,
and the agent loop's teacher scoring with the real transformers engine on the tiny
model (alignment of the teacher's logprobs with the policy's tokens, privileged context,
a teacher of another model: SmolLM2-135M teaching the tiny model, which shares its tokenizer)."""

from __future__ import annotations

import math

import pytest

from opentinker.schemas import (
    EnvInitReply,
    EnvResetReply,
    EnvStepReply,
    JobSpec,
    RolloutRequest,
    SamplingParams,
    SpecError,
    TurnRecord,
    validate_job_spec,
)
from opentinker.schemas.rollout import Trajectory
from opentinker.services.learner.batching import StepAdvantages, distill_advantages, step_advantages
from opentinker.services.learner.step import plan_step
from opentinker.schemas.rollout import TEACHER_MISMATCH
from opentinker.services.rollout.agent_loop import AgentLoop
from opentinker.services.rollout.teacher import check_teacher_vocab

SYSTEM = "You count sheep."
USER = "Say a number."
SECRET = "The answer is 7."


def traj(reward: float, logprobs: list[float], teacher: list[float], error: str = "") -> Trajectory:
    """A 2-token prompt, then len(logprobs) policy tokens."""
    n = len(logprobs)
    return Trajectory(job_id="j", request_id="j-r", episode_id=f"e{reward}{n}", step=0, group_index=0, group_size=2,
                      token_ids=[1, 2] + [3] * n, loss_mask=[0, 0] + [1] * n, logprobs=[0.0, 0.0] + logprobs,
                      prompt_len=2, turns=[TurnRecord(gen_start=2, gen_end=2 + n, obs_end=2 + n, reward=reward)],
                      reward=reward, policy_version=0, error=error,
                      teacher_logprobs=[0.0, 0.0] + teacher if teacher else [])


def test_each_policy_token_gains_minus_alpha_times_its_reverse_kl():
    trajs = [traj(1.0, [-0.5, -1.0], [-0.25, -3.0]), traj(0.0, [-2.0], [-1.0])]
    adv = step_advantages(trajs, 1, 2)
    a_rl = adv.advantages  # GRPO: (1 - 0.5) / std, (0 - 0.5) / std
    assert a_rl[0] == pytest.approx(-a_rl[1]) and a_rl[0] > 0
    out, kl = distill_advantages(trajs, adv, 2, coef=0.5)
    # by hand: log pi - log pi_teacher = -0.25, 2.0 on episode 0; -1.0 on episode 1
    assert out.advantages[0] == pytest.approx([0.0, 0.0, a_rl[0] + 0.125, a_rl[0] - 1.0])
    assert out.advantages[1] == pytest.approx([0.0, 0.0, a_rl[1] + 0.5])
    assert kl == pytest.approx((-0.25 + 2.0 - 1.0) / 3)
    only, _ = distill_advantages(trajs, adv, 2, coef=0.5, only=True)
    assert only.advantages == [pytest.approx([0.0, 0.0, 0.125, -1.0]), pytest.approx([0.0, 0.0, 0.5])]
    assert only.zero_groups == [False]


def test_a_group_of_equal_rewards_still_learns_from_the_teacher_and_an_excluded_episode_stays_out():
    trajs = [traj(1.0, [-0.5], [-0.5]), traj(1.0, [-1.0], [-0.5])]
    adv = step_advantages(trajs, 1, 2)
    assert adv.zero_groups == [True]
    out, _ = distill_advantages(trajs, adv, 2, coef=1.0)
    # log pi - log pi_teacher = -1.0 + 0.5: the teacher likes the token more, the advantage rises
    assert out.zero_groups == [False] and out.advantages[1] == pytest.approx([0.0, 0.0, 0.5])
    # the teacher agrees with every token: no signal
    same, kl = distill_advantages([trajs[0], trajs[0]], step_advantages([trajs[0], trajs[0]], 1, 2), 2, 1.0)
    assert same.zero_groups == [True] and kl == 0.0
    excluded = StepAdvantages([0.0, 0.0], [True, True], [True])
    out, kl = distill_advantages(trajs, excluded, 2, coef=1.0)
    assert out.advantages == [[0.0] * 3, [0.0] * 3] and out.excluded == [True, True] and math.isnan(kl)


def test_a_trained_episode_without_teacher_logprobs_is_refused():
    trajs = [traj(1.0, [-0.5], [-0.5]), traj(0.0, [-1.0], [])]
    with pytest.raises(ValueError, match="episode 1: 0 teacher logprobs for 3 tokens"):
        distill_advantages(trajs, step_advantages(trajs, 1, 2), 2, coef=1.0)


def test_plan_step_reports_the_teacher_kl_and_trains_a_group_of_equal_rewards():
    spec = JobSpec(prompts_per_step=1, group_size=2, teacher="base", distill_coef=1.0, distill_only=True)
    trajs = [traj(1.0, [-0.5, -1.0], [-0.25, -3.0]), traj(1.0, [-2.0], [-1.0])]
    plan = plan_step(trajs, validate_job_spec(spec), 0, pad_id=0)
    assert plan.stats["teacher_kl"] == pytest.approx((-0.25 + 2.0 - 1.0) / 3)
    assert plan.stats["skipped_frac"] == 0.0  # equal rewards, but the teacher's signal: forwarded
    [mb] = plan.micro_batches
    # target-aligned (column j is token j + 1); the plan shuffles the episodes
    rows = sorted(mb.advantages.tolist(), key=lambda r: r[2])
    assert rows == [pytest.approx([0.0, 0.25, -2.0, 0.0]), pytest.approx([0.0, 1.0, 0.0, 0.0])]


@pytest.mark.parametrize("changes, field", [
    ({"teacher": "base"}, "distill_coef"),
    ({"distill_coef": 0.5}, "distill_coef"),
    ({"teacher": "job", "distill_coef": 1.0}, "teacher_job"),
    ({"teacher": "base", "teacher_job": "other-job", "distill_coef": 1.0}, "teacher_job"),
    ({"teacher": "job", "teacher_job": "Not An Id", "distill_coef": 1.0}, "teacher_job"),
    ({"teacher": "self", "distill_coef": 1.0}, "teacher"),
    ({"teacher_context": "privileged"}, "teacher_context"),
    ({"teacher": "model", "distill_coef": 1.0}, "teacher_model"),
    ({"teacher": "base", "teacher_model": "org/bigger", "distill_coef": 1.0}, "teacher_model"),
    ({"teacher": "model", "teacher_model": "smollm2-135m-instruct", "distill_coef": 1.0}, "teacher_model"),
    ({"teacher": "model", "teacher_model": "x" * 1025, "distill_coef": 1.0}, "teacher_model"),
    ({"distill_only": True}, "distill_only"),
    ({"teacher": "base", "distill_coef": 1.0, "agents": 2}, "teacher"),
    ({"teacher": "base", "distill_coef": 1.0, "algorithm": "sft", "sft_data": "x.jsonl"}, "teacher"),
    ({"teacher": "base", "distill_coef": 1.0, "sampling": SamplingParams(temperature=0.7)}, "sampling.temperature"),
    ({"teacher": "base", "distill_coef": 1.0, "distill_only": True, "dynamic_sampling": 4}, "dynamic_sampling"),
])
def test_distillation_options_are_checked(changes, field):
    with pytest.raises(SpecError) as e:
        validate_job_spec(JobSpec(**changes))
    assert e.value.field == field


def test_valid_distillation_specs_pass():
    for changes in ({"teacher": "job", "teacher_job": "arith-main", "distill_coef": 1.0, "distill_only": True},
                    {"teacher": "self", "teacher_context": "privileged", "distill_coef": 0.1},
                    {"teacher": "base", "teacher_context": "privileged", "distill_coef": 1.0},
                    {"teacher": "model", "teacher_model": "org/bigger", "distill_coef": 1.0}):
        validate_job_spec(JobSpec(**changes))


class SecretGame:
    """Two turns of counting; the reset reply carries privileged context."""

    def __init__(self, context: str = SECRET):
        self.context = context
        self.privileged_asked: list[bool] = []
        self.steps: dict[str, int] = {}

    async def init(self, req):
        return EnvInitReply(state={})

    async def reset(self, req):
        self.privileged_asked.append(req.privileged)
        self.steps[req.episode_id] = 0
        return EnvResetReply(host_id="h1", system_prompt=SYSTEM, user_message=USER,
                             privileged_context=self.context if req.privileged else "")

    async def step(self, host_id, req):
        self.steps[req.episode_id] += 1
        return EnvStepReply(observation="Again.", reward=0.5, done=self.steps[req.episode_id] >= 2)

    async def close(self, host_id, req):
        pass


@pytest.fixture(scope="module")
def engine(tiny_model):
    from opentinker.services.rollout.engine_hf import HFEngine

    return HFEngine(tiny_model, seed=3)


def request(**kw) -> RolloutRequest:
    return RolloutRequest(job_id="j1", request_id="j1-r1", step=0, group_index=0, group_seed=1, policy_version=0,
                          model="tiny", env="secret", group_size=2,
                          sampling=SamplingParams(max_new_tokens=5, max_turns=2, max_total_tokens=512), **kw)


class Versions:
    """policy_version: records how the loop asked for weights (the engine keeps its own)."""

    def __init__(self):
        self.asked: list[tuple[str, bool]] = []

    async def __call__(self, of: str = "", base: bool = False) -> int:
        self.asked.append((of, base))
        return 0


async def test_the_base_teacher_scores_each_policy_token_as_the_sampler_did(engine):
    """At policy version 0 the sampler is the base model at temperature 1: the teacher's
    logprob of every policy token (over two turns, an observation between) is the
    sampler's own, so the alignment is exact."""
    versions = Versions()
    [trajs] = await AgentLoop(engine, SecretGame()).run([request(teacher="base")], versions)
    assert ("", True) in versions.asked
    for t in trajs:
        assert not t.error and len(t.turns) == 2 and len(t.teacher_logprobs) == len(t.token_ids)
        for m, lp, tlp in zip(t.loss_mask, t.logprobs, t.teacher_logprobs):
            assert tlp == (pytest.approx(lp, abs=2e-4) if m else 0.0)


async def test_a_privileged_teacher_reads_the_context_after_the_user_message(engine):
    game = SecretGame()
    versions = Versions()
    [trajs] = await AgentLoop(engine, game).run(
        [request(teacher="job", teacher_job="teach-1", teacher_context="privileged")], versions)
    assert game.privileged_asked == [True, True] and ("teach-1", False) in versions.asked
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": f"{USER}\n\n{SECRET}"}],
                                   add_generation_prompt=True, tokenize=False)
    teacher_prompt = list(tok(text, add_special_tokens=False)["input_ids"])
    for t in trajs:
        assert not t.error
        # the policy never read the secret
        assert SECRET not in tok.decode(t.token_ids)
        seq = teacher_prompt + t.token_ids[t.prompt_len:]
        [lps] = engine.prompt_logprobs([seq])
        shift = len(teacher_prompt) - t.prompt_len
        expect = [lps[j + shift] if m else 0.0 for j, m in enumerate(t.loss_mask)]
        assert t.teacher_logprobs == pytest.approx(expect, abs=1e-5)
        # the context changes what the teacher expects
        assert any(abs(a - b) > 1e-3 for a, b, m in zip(t.teacher_logprobs, t.logprobs, t.loss_mask) if m)


async def test_an_env_without_privileged_context_ends_the_episodes_naming_it(engine):
    [trajs] = await AgentLoop(engine, SecretGame(context="")).run(
        [request(teacher="self", teacher_context="privileged")], Versions())
    for t in trajs:
        assert "gave no privileged context" in t.error and "get_privileged_context" in t.error
        assert t.teacher_logprobs == []


async def test_without_a_teacher_nothing_is_scored(engine):
    game = SecretGame()
    versions = Versions()
    [trajs] = await AgentLoop(engine, game).run([request()], versions)
    assert game.privileged_asked == [False, False] and all(a == ("", False) for a in versions.asked)
    assert all(t.teacher_logprobs == [] for t in trajs)


async def test_a_teacher_of_another_model_scores_the_policy_tokens_on_its_own_engine(engine, smollm2):
    """teacher = "model": SmolLM2-135M (the tiny model's tokenizer, other weights) scores
    the tiny policy's tokens through score_by_model: its prompt logprobs of the episode's
    sequence, aligned with the policy's tokens, far from the sampler's own."""
    from opentinker.services.rollout.engine_hf import HFEngine

    teacher = HFEngine(smollm2, seed=3)
    asked: list[str] = []

    async def score_by_model(model, seqs, **vision):
        asked.append(model)
        check_teacher_vocab(engine.tokenizer, teacher.tokenizer, model)
        return teacher.prompt_logprobs(seqs)

    versions = Versions()
    [trajs] = await AgentLoop(engine, SecretGame(), score_by_model=score_by_model).run(
        [request(teacher="model", teacher_model="the-teacher")], versions)
    assert asked == ["the-teacher"] and all(not base for _, base in versions.asked)  # the student's engine untouched
    for t in trajs:
        assert not t.error and len(t.teacher_logprobs) == len(t.token_ids)
        [lps] = teacher.prompt_logprobs([t.token_ids])
        assert t.teacher_logprobs == pytest.approx([lps[j] if m else 0.0 for j, m in enumerate(t.loss_mask)],
                                                   abs=1e-5)
        gap = [lp - tlp for lp, tlp, m in zip(t.logprobs, t.teacher_logprobs, t.loss_mask) if m]
        assert max(abs(g) for g in gap) > 0.1  # another model's judgement, not the sampler's


async def test_a_teacher_model_that_cannot_score_ends_the_episodes_naming_it(engine):
    """No way to load a teacher model, or one with another vocabulary: the episodes end
    with an error starting with TEACHER_MISMATCH (the learner then fails the job)."""
    [trajs] = await AgentLoop(engine, SecretGame()).run([request(teacher="model", teacher_model="m")], Versions())
    assert all(t.error.startswith(TEACHER_MISMATCH) and "cannot load a teacher model" in t.error for t in trajs)

    class OtherTokenizer:
        def get_vocab(self):
            return {**engine.tokenizer.get_vocab(), "<image>": 49152}

    async def score_by_model(model, seqs, **vision):
        check_teacher_vocab(engine.tokenizer, OtherTokenizer(), model)
        raise AssertionError("scored with another vocabulary")

    [trajs] = await AgentLoop(engine, SecretGame(), score_by_model=score_by_model).run(
        [request(teacher="model", teacher_model="org/vlm")], Versions())
    for t in trajs:
        assert t.error.startswith(TEACHER_MISMATCH) and "'org/vlm' has another vocabulary" in t.error, t.error
        assert "'<image>', 49152" in t.error and t.teacher_logprobs == []
