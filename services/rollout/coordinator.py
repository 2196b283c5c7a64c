"""The multi-agent coordinator: episodes of a MultiAgentGame (environment/multi_agent.py)
where two or more seats take turns in one game, each played by the job's policy or,
for the seats RolloutRequest.opponents names, by another job's (its newest weights;
the agent loop makes one engine call per policy each round).

An episode (a "game") moves through phases. The envhost names the seats acting in
each phase; their prompts join the agent loop's next batched engine call like any
single-agent episode, and once every acting seat has its action the coordinator sends
the phase to the env in one step (phase-level synchronisation: a seat never sees
another's action of the same phase). What the env addresses to a seat is buffered
until that seat acts again, then appended to its own conversation as a user turn.

Every seat keeps its own token-exact sequence (prompt, its actions with loss mask 1,
the observations addressed to it with mask 0) and becomes one Trajectory with
`agent` set and the game's id in `game_id`. A seat's turn reward is what the env gave
it in the phase it acted plus what later phases gave it before it acted again (its
opponent's winning move is a loss for the move that allowed it).

Limits: `sampling.max_turns` counts each seat's turns; a game ends when an acting seat
reached it, or when a seat's next prompt would pass the token budget. Every seat of a
game ends together, on the same error if there is one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentinker.schemas import EnvStepRequest, RolloutRequest, TurnRecord
from opentinker.services.core import tracing

if TYPE_CHECKING:
    from opentinker.services.rollout.agent_loop import AgentLoop, GenOut, _Episode


@dataclass
class OpenTurn:
    """A seat's last turn, until the observation that follows it is appended."""

    gen_start: int
    gen_end: int
    reward: float
    policy_version: int
    finish_reason: str
    action: str
    phase: int
    gen_ms: float
    env_ms: float
    observation: list[str] = field(default_factory=list)


@dataclass
class Game:
    """One multi-agent episode: its seats (one _Episode each) and where it stands."""

    req: RolloutRequest
    game_id: str
    seats: dict[str, _Episode] = field(default_factory=dict)  # in seat order
    host_id: str = ""
    acting: list[str] = field(default_factory=list)
    phase: int = 0
    inbox: dict[str, list[str]] = field(default_factory=dict)  # seat -> observations not yet read
    carry: dict[str, float] = field(default_factory=dict)  # seat -> reward earned before its first turn
    open: dict[str, OpenTurn] = field(default_factory=dict)
    opening: dict[str, tuple[str, str]] = field(default_factory=dict)  # seat -> (system, user)


class Coordinator:
    """Runs the phases of multi-agent games for an AgentLoop (its engine, renderer and
    env client)."""

    def __init__(self, loop: AgentLoop):
        self.loop = loop

    # -- opening ------------------------------------------------------------------

    def _prompt(self, g: Game, agent: str) -> None:
        system, user = g.opening[agent]
        if g.inbox.get(agent):
            user = "\n\n".join(x for x in (user, *g.inbox.pop(agent)) if x)
        g.seats[agent].open_prompt(self.loop.renderer, system, user)

    def seat_up(self, g: Game, agent: str) -> bool:
        """Render a seat's prompt the first time it acts: its opening message and what
        it was told before then. False (and the game failed) past the token budget."""
        self._prompt(g, agent)
        if too_long := g.seats[agent].prompt_too_long(self.loop._budget(g.req)):
            self.fail(g, f"seat {agent}: {too_long}")
            return False
        return True

    def start(self, g: Game) -> None:
        """After the reset: the first phase's seats generate."""
        from opentinker.services.rollout.agent_loop import Phase

        for e in g.seats.values():
            e.phase = Phase.INTERACTING  # waiting for its phase
        self._next(g)

    # -- a phase ------------------------------------------------------------------

    async def phase(self, g: Game, outs: dict[str, tuple[GenOut, int]], gen_ms: float) -> None:
        """The acting seats' completions of this phase, each with the policy version
        that sampled it: record them, step the env with all of them at once, then
        route its observations and rewards."""
        from opentinker.services.rollout.agent_loop import Phase

        actions: dict[str, str] = {}
        for agent, (out, version) in outs.items():
            e = g.seats[agent]
            e.phase = Phase.INTERACTING
            gen_start = len(e.token_ids)
            actions[agent] = e.add_action(out, gen_ms, self.loop.engine.tokenizer)
            g.open[agent] = OpenTurn(gen_start=gen_start, gen_end=len(e.token_ids), reward=g.carry.pop(agent, 0.0),
                                     policy_version=version, finish_reason=out.finish_reason,
                                     action=actions[agent], phase=g.phase, gen_ms=gen_ms, env_ms=0.0)
        t0 = time.perf_counter()
        reply, error = None, ""
        first = next(iter(outs))
        try:
            with tracing.within(g.seats[first].span), tracing.span(
                    "rollout.env_step", kind=tracing.SpanKind.CLIENT, attrs={"ot.phase": g.phase}):
                reply = await self.loop.env.step(g.host_id, EnvStepRequest(
                    episode_id=g.game_id, actions=actions, job_id=g.req.job_id))
        except Exception as err:  # EnvError: the transport; the game ends with it
            error = f"env step: {err}"
        env_ms = (time.perf_counter() - t0) * 1e3
        for agent in outs:
            g.open[agent].env_ms = env_ms
            g.seats[agent].env_ms += env_ms
        if reply is not None and reply.error:
            error = f"env step: {reply.error}"
        g.phase += 1
        if reply is not None:
            for e in g.seats.values():
                e.info = dict(reply.info)
            for agent, r in reply.rewards.items():
                if agent in g.open:
                    g.open[agent].reward += r
                else:
                    g.carry[agent] = g.carry.get(agent, 0.0) + r
            for agent, text in reply.observations.items():
                if agent in g.open:
                    g.open[agent].observation.append(text)
                g.inbox.setdefault(agent, []).append(text)
        if error:
            self.fail(g, error)
            if reply is None:
                await self.loop._close(next(iter(g.seats.values())))
            return
        if reply.done:
            self.end(g)
            return
        g.acting = list(reply.acting)
        if not self._next(g):
            await self.loop._close(next(iter(g.seats.values())))

    def _next(self, g: Game) -> bool:
        """Open the acting seats' next turns (their buffered observations appended).
        False when the game ended instead (turn limit, token budget, a bad seat)."""
        from opentinker.services.rollout.agent_loop import Phase

        loop = self.loop
        unknown = [a for a in g.acting if a not in g.seats]
        if not g.acting or unknown:
            self.fail(g, f"env: acting seats {g.acting} are not among {list(g.seats)}")
            return False
        if any(len(g.seats[a].turns) + (a in g.open) >= g.req.sampling.max_turns for a in g.acting):
            self.end(g)
            return False
        for agent in g.acting:
            e = g.seats[agent]
            if not e.messages:
                if not self.seat_up(g, agent):
                    return False
                continue
            text = "\n\n".join(g.inbox.pop(agent, []))
            last = e.token_ids[-1] if e.loss_mask and e.loss_mask[-1] else None
            turn = g.open[agent]
            obs_ids = loop.renderer.observation_ids(e.messages, text, last, turn.finish_reason)
            if len(e.token_ids) + len(obs_ids) >= loop._budget(g.req):
                self.end(g)
                return False
            e.add_observation(self.loop.renderer, obs_ids, "user", text)
            self._record(e, g.open.pop(agent))
        for agent in g.acting:
            g.seats[agent].phase = Phase.GENERATING
        return True

    # -- the end ------------------------------------------------------------------

    def _record(self, e: _Episode, t: OpenTurn) -> None:
        e.turns.append(TurnRecord(gen_start=t.gen_start, gen_end=t.gen_end, obs_end=len(e.token_ids),
                                  reward=t.reward, policy_version=t.policy_version, finish_reason=t.finish_reason,
                                  action=t.action, observation="\n\n".join(t.observation), gen_ms=t.gen_ms,
                                  env_ms=t.env_ms, phase=t.phase))

    def end(self, g: Game) -> None:
        """Every seat ends: each open turn is recorded as it stands."""
        from opentinker.services.rollout.agent_loop import Phase

        for agent, e in g.seats.items():
            if not e.messages and agent in g.opening and not e.error:
                self._prompt(g, agent)  # a seat that never acted: its prompt, no turn
            if agent in g.open:
                self._record(e, g.open.pop(agent))
            if agent in g.carry:  # earned after its last turn, with no turn to credit
                e.info = {**e.info, "unattributed_reward": g.carry.pop(agent)}
            e.phase = Phase.TERMINATED

    def fail(self, g: Game, error: str) -> None:
        for e in g.seats.values():
            e.error = error
        self.end(g)

