"""The environment API a user implements (faithful to OpenTinker's AbstractGame).

An environment is the user's only code: the same class drives training, evaluation
and inference. It is served by `opentinker envhost --env my_module:MyGame`.

    class MyGame(AbstractGame):
        name = "my-game"
        def reset(self, **state) -> str: ...            # first observation
        def step(self, action: str) -> StepResult: ...   # one turn
        def get_system_prompt(self) -> str: ...
        def get_initial_user_message(self) -> str: ...
        def generate_initial_state(self, seed: int) -> dict: ...  # data-free envs
        def get_tools(self) -> list[dict]: ...           # optional: tools the model may call

`__init__(**env_args)` receives the job's `env_args`. One instance serves one episode.

Tool use: an env that returns OpenAI-style function schemas from `get_tools()` has
them rendered by the model's chat template when the template defines tools (and its
observations sent back as `tool` messages); with a template that does not, the env's
own system prompt describes the format (e.g. a fenced code block). `step` parses
either from the action text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    """What `step` returns. `reward` is this turn's reward; `done` ends the episode."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class AbstractGame:
    """Base class for environments. Subclasses set `name` ([a-z0-9_-]) and override
    `reset`, `step`, `get_system_prompt`, `get_initial_user_message`."""

    name: str = ""
    #: True for multi-turn games (observations fed back to the model)
    multi_turn: bool = False

    def __init__(self, **env_args: Any):
        self.env_args = env_args

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """The kwargs for `reset` shared by one GRPO group. Default: just the seed."""
        return {"seed": seed}

    def reset(self, **state: Any) -> str:
        """Start an episode from `state`; returns the first observation (may be "")."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        """Apply the model's `action` text; returns observation, reward, done, info."""
        raise NotImplementedError

    def get_system_prompt(self) -> str:
        return ""

    def get_tools(self) -> list[dict[str, Any]]:
        """Tools the model may call, as OpenAI-style function schemas
        (`{"type": "function", "function": {"name", "description", "parameters"}}`).
        Default: none."""
        return []

    def get_initial_user_message(self) -> str:
        raise NotImplementedError

    @staticmethod
    def rng(seed: int) -> random.Random:
        return random.Random(seed)
