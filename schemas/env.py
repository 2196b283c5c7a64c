"""Environment RPC (rollout -> envhost), NATS core request/reply.

Init and reset go to the env's queue group (`ot.env.<env>.init` / `.reset`); the host
that answers a reset owns the episode, and its steps go to `ot.env.host.<host_id>.step`.
"""

from typing import Any

import msgspec

from opentinker.schemas.base import Count, Message


class EnvInitRequest(Message, frozen=True, kw_only=True):
    """Make a group's initial state: `generate_initial_state(seed=seed)`."""

    env: str
    env_args: dict[str, Any] = msgspec.field(default_factory=dict)
    seed: Count = 0
    split: str = "train"


class EnvInitReply(Message, frozen=True, kw_only=True):
    state: dict[str, Any] = msgspec.field(default_factory=dict)
    error: str = ""


class EnvResetRequest(Message, frozen=True, kw_only=True):
    """Start an episode: construct the env with `env_args`, call `reset(**state)`.
    An envhost keys its episodes by (`job_id`, `episode_id`): one job's ids can never
    reach another job's games."""

    env: str
    episode_id: str
    job_id: str = ""
    env_args: dict[str, Any] = msgspec.field(default_factory=dict)
    state: dict[str, Any] = msgspec.field(default_factory=dict)


class AgentOpening(msgspec.Struct, frozen=True, kw_only=True):
    """One seat of a multi-agent episode: its name and its own opening messages."""

    agent: str
    system_prompt: str = ""
    user_message: str = ""


class EnvResetReply(Message, frozen=True, kw_only=True):
    """The episode's opening: system prompt and first user message (with `images`,
    for a vision-language env). `host_id` is where its steps go. `tools`: the env's
    `get_tools()` (OpenAI-style function schemas).

    A multi-agent env (environment/multi_agent.py) fills `agents` (every seat's opening,
    in seat order) and `acting` (the seats that act in the first phase) instead."""

    host_id: str = ""
    system_prompt: str = ""
    user_message: str = ""
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    error: str = ""
    agents: list[AgentOpening] = msgspec.field(default_factory=list)
    acting: list[str] = msgspec.field(default_factory=list)
    # the images shown with the first user message, in order (PNG or JPEG bytes; the
    # env's `get_initial_images()`, checked by environment/images.py)
    images: list[bytes] = msgspec.field(default_factory=list)


class EnvStepRequest(Message, frozen=True, kw_only=True):
    """One turn: `action` for a single-agent env; for a multi-agent env one phase,
    `actions` by seat (exactly the seats the last reply named as acting)."""

    episode_id: str
    action: str = ""
    job_id: str = ""
    actions: dict[str, str] = msgspec.field(default_factory=dict)


class EnvStepReply(Message, frozen=True, kw_only=True):
    """`env.step(action)`. On an exception in user code, `error` holds the reason and
    `done` is true (the episode ends; the job goes on).

    A multi-agent phase fills `observations` and `rewards` by seat (what each seat reads
    before it next acts, what it earned this phase) and `acting` (the next phase's
    seats); `observation`/`reward` stay empty."""

    observation: str = ""
    reward: float = 0.0
    done: bool = True
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    error: str = ""
    observations: dict[str, str] = msgspec.field(default_factory=dict)
    rewards: dict[str, float] = msgspec.field(default_factory=dict)
    acting: list[str] = msgspec.field(default_factory=list)
    # the images shown with the observation, in order (StepResult.images; PNG or JPEG)
    images: list[bytes] = msgspec.field(default_factory=list)


class EnvCloseRequest(Message, frozen=True, kw_only=True):
    episode_id: str
    job_id: str = ""
