"""Multi-agent environments: two or more seats taking turns in one game, every seat
played by a policy being trained (self-play).

An episode runs in phases. In each phase the env names the seats that act
(`acting_agents()`: one seat for a turn-based game, several for simultaneous moves);
the rollout coordinator samples an action for each of them, in one engine call with
every other episode's, and hands the env all of the phase's actions at once
(`step_phase`). That is phase-level synchronisation: no seat sees another's action of
the same phase, and the env advances only when the phase is complete (the multi-agent
scheme of the OpenTinker paper, a coordinator with phase barriers).

Each seat has its own conversation: its system prompt, its opening message, the
observations the env addressed to it, its own actions. It becomes one trajectory, with
its own loss mask and its own reward (the sum of its phase rewards), so credit is per
agent: the learner normalizes each seat's return against the same seat in the other
episodes of the group (JobSpec.agents).

    class DuelGame(MultiAgentGame):
        agents = ("first", "second")
        def reset(self, **state): ...                   # shared setup; returns ""
        def get_agent_system_prompt(self, agent): ...
        def get_agent_user_message(self, agent): ...   # the seat's opening message
        def acting_agents(self): ...                     # seats acting this phase
        def step_phase(self, actions): ...               # {seat: text} -> PhaseResult
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult


@dataclass
class PhaseResult:
    """What `step_phase` returns.

    observations: seat -> text that seat reads before it acts next (seats not named
        read nothing new; several phases' texts for a seat are joined by a blank line)
    rewards: seat -> this phase's reward (missing seats: 0)
    done: the episode ends
    """

    observations: dict[str, str]
    rewards: dict[str, float]
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class MultiAgentGame(AbstractGame):
    """Base class for multi-agent (self-play) environments; see the module docstring.

    Required: the class attribute `agents` (seat names, [a-z0-9_-]+, at least two, in
    seat order), `reset`, `get_agent_user_message`, `acting_agents`, `step_phase`.
    """

    #: the seats, in order
    agents: tuple[str, ...] = ()

    def get_agent_system_prompt(self, agent: str) -> str:
        """The seat's system prompt. Default: get_system_prompt()."""
        return self.get_system_prompt()

    def get_agent_user_message(self, agent: str) -> str:
        """The seat's first user message, asked after `reset`."""
        raise NotImplementedError

    def acting_agents(self) -> list[str]:
        """The seats that act in the current phase (non-empty while the game runs)."""
        raise NotImplementedError

    def step_phase(self, actions: dict[str, str]) -> PhaseResult:
        """Apply one phase: `actions` holds exactly the acting seats' texts."""
        raise NotImplementedError

    def get_initial_user_message(self) -> str:
        return self.get_agent_user_message(self.agents[0])

    def step(self, action: str) -> StepResult:
        """A single-agent view is not served: a multi-agent game needs a job with
        `agents` set to its number of seats."""
        raise TypeError(f"{type(self).__name__} is a multi-agent game with seats {list(self.agents)}: "
                        f"train it with agents = {len(self.agents)} in the job spec")
