"""Rollout requests (learner -> rollout) and trajectories (rollout -> learner, recorder).

A RolloutRequest asks for one GRPO group: `group_size` episodes that share one initial
environment state. A Trajectory is one episode.
"""

from typing import Any, Literal

import msgspec

from opentinker.schemas.base import Count, MaskBit, Message, TokenId
from opentinker.schemas.job import MAX_GROUP_SIZE, Bounded, Engine, SamplerDtype, SamplingParams


# The start of an episode's error when the job's `agents` does not fit its env's
# seats: the spec is wrong, so the learner fails the job instead of asking again.
SEATS_MISMATCH = "agents: "
# Likewise when `teacher_model` cannot score the policy's tokens (another vocabulary).
TEACHER_MISMATCH = "teacher_model: "

# What an episode is for: a training step's group, a learner's evaluation, or an
# inference job / `opentinker infer`. The learner routes trajectories on it.
Purpose = Literal["train", "eval", "inference"]


class RolloutRequest(Message, frozen=True, kw_only=True):
    """One group of episodes to sample (subject `ot.job.<id>.rollout`).

    `policy_version` is the newest version the learner had published when it asked;
    a worker samples with that version or a newer one of the same `policy_run` (the
    learner run whose weights these are; "" = whatever the job's newest weight event is,
    as for an inference job). `attempt` is the job's placement attempt the asker runs
    under: a worker serves only requests of the attempt the job record names. `group_seed`
    fixes the group's initial state (the env's `generate_initial_state(seed=...)`).
    `request_id` starts with `<job_id>-`.
    """

    job_id: str
    request_id: str
    step: Count
    group_index: Count
    group_seed: Count
    policy_version: Count
    model: str
    env: str
    env_args: dict[str, Any] = msgspec.field(default_factory=dict)
    # 1 for evaluation and inference groups; a training spec's group_size is >= 2
    group_size: Bounded(int, 1, MAX_GROUP_SIZE) = 8
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    engine: Engine = "auto"
    sampler_dtype: SamplerDtype = "auto"
    split: str = "train"
    attempt: Count = 0
    policy_run: str = ""
    purpose: Purpose = "train"
    # seats per episode (JobSpec.agents): a multi-agent env's episode gives one
    # trajectory per seat, so a group gives group_size * agents
    agents: Bounded(int, 1, 8) = 1
    # seats another job's policy plays (JobSpec.opponents: seat -> job id)
    opponents: dict[str, str] = msgspec.field(default_factory=dict)
    # on-policy distillation (JobSpec.teacher, .teacher_job, .teacher_model, .teacher_context): after an
    # episode, the worker scores its tokens with the teacher's policy (Trajectory.teacher_logprobs)
    teacher: Literal["none", "job", "base", "self", "model"] = "none"
    teacher_job: str = ""
    teacher_model: str = ""
    teacher_context: Literal["none", "privileged"] = "none"


class TurnRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of an episode. `[gen_start, gen_end)` indexes the policy tokens of this
    turn in Trajectory.token_ids; the observation that followed (if any) is
    `[gen_end, obs_end)`. Times in milliseconds."""

    gen_start: Count
    gen_end: Count
    obs_end: Count
    reward: float = 0.0
    policy_version: Count = 0
    finish_reason: str = ""
    action: str = ""
    observation: str = ""
    gen_ms: float = 0.0
    env_ms: float = 0.0
    # a multi-agent episode's phase this turn was taken in (-1: single-agent)
    phase: int = -1
    # images the observation after this turn showed (the next of Trajectory.images)
    images: Count = 0


class Trajectory(Message, frozen=True, kw_only=True):
    """One episode, token-exact.

    token_ids:   [seq] int   every token the engine saw or produced, in order
    loss_mask:   [seq] int   1 = policy (sampled) token, 0 = prompt/observation token
    logprobs:    [seq] float sampler logprob of each policy token, 0.0 elsewhere
    prompt_len:  the length of the first prompt (system + first user message)
    reward:      the episode return (sum of per-turn rewards)
    policy_version: the oldest policy version that produced any turn
    policy_run:  the learner run whose weights produced it ("" for version 0, the base
                 model): versions are numbered per run, so a resumed run tells its own
                 policy from a lost run's of the same number
    error:       non-empty when the episode ended on an environment or engine error
    agent:       the seat this trajectory played in a multi-agent episode ("" for a
                 single-agent env); the episode's other seats share `game_id`
    policy_of:   the job whose policy played this seat when it is not the trajectory's
                 own job (JobSpec.opponents): its versions are that job's, and the
                 learner never trains on it
    teacher_logprobs: [seq] float with a teacher (RolloutRequest.teacher): the teacher's
                 logprob of each policy token (temperature 1; with privileged context,
                 after the teacher's own prompt), 0.0 elsewhere; [] without one
    images:      every image the policy saw (PNG or JPEG bytes), in the order their
                 placeholder tokens appear in token_ids: the first prompt's, then each
                 turn's observation's (TurnRecord.images of them). The learner feeds
                 them to a vision-language model's forward; the log stores them by hash
    """

    job_id: str
    request_id: str
    episode_id: str
    step: Count
    group_index: Count
    group_size: Count
    token_ids: list[TokenId]
    loss_mask: list[MaskBit]
    logprobs: list[float]
    prompt_len: Count
    turns: list[TurnRecord]
    reward: float
    policy_version: Count
    env: str = ""
    split: str = "train"
    purpose: Purpose = "train"  # the request's (RolloutRequest.purpose)
    env_info: dict[str, Any] = msgspec.field(default_factory=dict)
    error: str = ""
    worker: str = ""
    engine: str = ""
    gen_ms: float = 0.0
    env_ms: float = 0.0
    created_s: float = 0.0
    policy_run: str = ""
    agent: str = ""
    game_id: str = ""
    images: list[bytes] = msgspec.field(default_factory=list)
    policy_of: str = ""
    teacher_logprobs: list[float] = msgspec.field(default_factory=list)

    @property
    def correct(self) -> bool:
        """Solved? The env's own `correct` info when it reports one, else reward > 0
        (how evaluation and inference count accuracy)."""
        c = self.env_info.get("correct")
        return bool(c) if c is not None else self.reward > 0
