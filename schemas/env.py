"""Environment RPC (rollout -> envhost), NATS core request/reply.

Init and reset go to the env's queue group (`ot.env.<env>.init` / `.reset`); the host
that answers a reset owns the episode, and its steps go to `ot.env.host.<host_id>.step`.
"""

import math
from typing import Any

import msgspec

from opentinker.schemas.base import Count, Message


class EnvInitRequest(Message, frozen=True, kw_only=True):
    """Make a group's initial state: `generate_initial_state(seed=seed)`."""

    env: str
    env_args: dict[str, Any] = msgspec.field(default_factory=dict)
    seed: Count = 0
    split: str = "train"
    job_id: str = ""  # whose env_args these are: an operator's envhost confines their paths


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
    # ask for the env's get_privileged_context() (a distillation teacher's context)
    privileged: bool = False


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
    # with EnvResetRequest.privileged: the env's get_privileged_context(), what a
    # distillation teacher reads after the first user message and the policy never sees
    privileged_context: str = ""


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


class EnvInfoRequest(Message, frozen=True, kw_only=True):
    """Does an envhost serve `env` here? Asked on `ot.env.<env>.info` (the operator's)
    or `ot.env.user.<user>.<env>.info` (user's own) by the scheduler at submit."""

    env: str


class EnvInfoReply(Message, frozen=True, kw_only=True):
    """`env` is served by `host_id`; `multi_agent`: its class is a MultiAgentGame."""

    env: str
    host_id: str = ""
    multi_agent: bool = False


class EnvServed(Message, frozen=True, kw_only=True):
    """The operator's env catalog (KV `ot_envs`, by env name): an operator envhost served
    `env` at `time_s` (unix s). A name stays in the catalog after its hosts stop, so a job
    submitted while the envhost restarts is not refused; its episodes wait for the host."""

    env: str
    host_id: str = ""
    time_s: float = 0.0


# What the rollout takes from an env's reply (an operator's env or a tenant's own, which
# is untrusted input): a reply over any of these fails that episode with the reason.
MAX_ENV_TEXT_CHARS = 256 * 1024   # one observation, system prompt or user message
MAX_ENV_SEATS = 16                # seats named in one multi-agent reply
MAX_ENV_TOOLS = 64                # tool schemas of one env
MAX_ENV_JSON_BYTES = 64 * 1024    # `tools` and `info`, as msgpack
MAX_ENV_STATE_BYTES = 512 * 1024  # an initial state (generate_initial_state), as msgpack
MAX_ENV_REPLY_IMAGES = 8          # images in one reply (environment/images.py MAX_IMAGES)
MAX_ENV_REPLY_IMAGE_BYTES = 2 * 1024 * 1024  # one image, encoded (MAX_IMAGE_BYTES)
ENV_REPLY_BYTES = 1024 * 1024     # one reply of a tenant's envhost (its NATS payload limit)


def _text(field: str, value: str) -> str:
    return (f"`{field}`: {len(value)} characters is over the limit of {MAX_ENV_TEXT_CHARS}"
            if len(value) > MAX_ENV_TEXT_CHARS else "")


def _number(field: str, value: float) -> str:
    return "" if math.isfinite(value) else f"`{field}`: {value!r} is not a finite number"


def _images(images: list[bytes]) -> str:
    if len(images) > MAX_ENV_REPLY_IMAGES:
        return f"`images`: {len(images)} images is over the limit of {MAX_ENV_REPLY_IMAGES}"
    for i, img in enumerate(images):
        if len(img) > MAX_ENV_REPLY_IMAGE_BYTES:
            return f"`images[{i}]`: {len(img)} bytes is over the limit of {MAX_ENV_REPLY_IMAGE_BYTES}"
    return ""


def _json(field: str, value: Any) -> str:
    n = len(msgspec.msgpack.encode(value))
    return f"`{field}`: {n} bytes is over the limit of {MAX_ENV_JSON_BYTES}" if n > MAX_ENV_JSON_BYTES else ""


def check_env_reply(reply: msgspec.Struct) -> str:
    """Why the rollout must not use an env's decoded reply (EnvInitReply, EnvResetReply
    or EnvStepReply), or "" when every field is within the limits above: texts, seats,
    tools and info sizes, image count and bytes, rewards finite. (Types, e.g. `done` a
    bool, are checked by the typed decode; pixels by environment/images.py.)"""
    checks: list[str] = []
    if isinstance(reply, EnvInitReply):
        n = len(msgspec.msgpack.encode(reply.state))
        if n > MAX_ENV_STATE_BYTES:
            checks.append(f"`state`: {n} bytes is over the limit of {MAX_ENV_STATE_BYTES}")
    elif isinstance(reply, EnvResetReply):
        checks += [_text("system_prompt", reply.system_prompt), _text("user_message", reply.user_message),
                   _text("privileged_context", reply.privileged_context), _images(reply.images),
                   _json("tools", reply.tools)]
        if len(reply.tools) > MAX_ENV_TOOLS:
            checks.append(f"`tools`: {len(reply.tools)} tool schemas is over the limit of {MAX_ENV_TOOLS}")
        if len(reply.agents) > MAX_ENV_SEATS or len(reply.acting) > MAX_ENV_SEATS:
            checks.append(f"`agents`: more than {MAX_ENV_SEATS} seats")
        for a in reply.agents:
            checks += [_text(f"agents[{a.agent[:32]!r}].system_prompt", a.system_prompt),
                       _text(f"agents[{a.agent[:32]!r}].user_message", a.user_message)]
    elif isinstance(reply, EnvStepReply):
        checks += [_text("observation", reply.observation), _number("reward", reply.reward),
                   _images(reply.images), _json("info", reply.info)]
        if max(len(reply.observations), len(reply.rewards), len(reply.acting)) > MAX_ENV_SEATS:
            checks.append(f"`observations`/`rewards`/`acting`: more than {MAX_ENV_SEATS} seats")
        else:
            checks += [_text(f"observations[{a[:32]!r}]", o) for a, o in reply.observations.items()]
            checks += [_number(f"rewards[{a[:32]!r}]", r) for a, r in reply.rewards.items()]
    return next((c for c in checks if c), "")
