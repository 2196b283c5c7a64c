"""Two-player games trained by self-play (environment/multi_agent.py): both seats are
played by the job's policy, each seat gets its own trajectory and reward.

- `gomoku-duel`: gomoku between two seats, black (X, moves first) and white (O);
  turn-based, one seat acts per phase.
- `negotiation`: two seats split a pot of coins by simultaneous demands (the Nash
  demand game, Nash 1953, "Two-person cooperative games", Econometrica 21(1)),
  repeated for a few rounds with each side told the other's last demand; both seats
  act in every phase, so neither sees the other's demand of the same round.

Held out (`splits`): a problem is gomoku-duel's opening position or negotiation's pot.
Both spaces are small enough to list, so `splits.HeldOut` puts exactly
`held_out_count(N)` of the N problems in "test" and a group seed draws again until its
problem is of the asked split. gomoku-duel's defaults (7x7, one stone pair on the 5x5
centre) give N = 600 positions, 200 of them test (mirror images count as distinct);
with more opening pairs N is too large to list and a position's split is
`splits.split_of_key`, about a fifth "test"; with `opening=0` there is one position,
the empty board, and nothing to hold out. negotiation's default pots 6..12 are only
N = 7 problems, of which 1 (a pot of 9) is test: its defaults cannot give 200, and a
fixed `pot` is one problem, asked by both splits.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from opentinker.environment.multi_agent import MultiAgentGame, PhaseResult
from opentinker.services.envhost.envs.gomoku import (EMPTY, _finite, _int_in, cell_name, empties, opening_count,
                                                     opening_key, opening_keys, opening_stones, parse_move,
                                                     place_stones, render, wins_at)
from opentinker.services.envhost.envs.splits import ENUMERATE_MAX, HeldOut, check_split, draw, split_of_key

_NUMBER = re.compile(r"-?\d+")
DUEL_ILLEGAL = ("retry", "loss", "random")
#: negotiation's pots when env_args.pot is not given
POTS = range(6, 13)


def duel_key(stones: list[list[Any]]) -> str:
    """The canonical key of a gomoku-duel problem: its opening position."""
    return f"gomoku-duel:{opening_key(stones)}"


@functools.lru_cache(maxsize=64)
def duel_held_out(size: int, opening: int) -> HeldOut | None:
    """The split of every opening position, or None when there are more than
    ENUMERATE_MAX (then each position's split is `splits.split_of_key`)."""
    if opening_count(size, opening) > ENUMERATE_MAX:
        return None
    return HeldOut(f"gomoku-duel:{k}" for k in opening_keys(size, opening))


def duel_split_of(size: int, opening: int, stones: list[list[Any]]) -> str:
    """Which split the opening `stones` belong to ("train" when nothing is held out)."""
    held = duel_held_out(size, opening)
    return held.split_of(duel_key(stones)) if held else split_of_key(duel_key(stones))


def negotiation_key(pot: int) -> str:
    """The canonical key of a negotiation problem: its pot."""
    return f"negotiation:{pot}"


@functools.lru_cache(maxsize=1)
def negotiation_held_out() -> HeldOut:
    """The split of each of the default POTS."""
    return HeldOut(negotiation_key(p) for p in POTS)


class GomokuDuelGame(MultiAgentGame):
    """Gomoku (k in a row) between two seats of one policy: "black" plays X and moves
    first, "white" plays O.

    Rewards: `win_reward` to the winner and `loss_reward` to the loser in the phase
    the game is won (the loser's lands on its last move); 0 each for a full board; an
    illegal move (no move token, off the board, an occupied cell) costs its seat
    `illegal_penalty` and, under illegal="retry", the seat moves again; its
    `max_illegal`-th illegal move (or the first under illegal="loss") loses the game.
    Under illegal="random" a random empty cell is played for the seat instead (the
    penalty still applies), so games between weak early policies still reach an end.

    env_args:
      size:        board side, 5..15 (default 7)
      win_length:  stones in a row that win, 3..size (default 4)
      opening:     stone pairs (one X, one O) placed at random near the centre per
                   group seed, 0..win_length-1 (default 1), so games start apart
      illegal:     "retry" (default), "loss" or "random"
      illegal_penalty, max_illegal, win_reward, loss_reward: -0.1, 3, 1.0, -1.0

    info: result ("black", "white", "draw", "ongoing": who won), moves, illegal (by
    seat). Raises ValueError naming the env_arg for a bad value.
    """

    name = "gomoku-duel"
    agents = ("black", "white")
    STONE = {"black": "X", "white": "O"}

    def __init__(self, size: int = 7, win_length: int = 4, opening: int = 1, illegal: str = "retry",
                 illegal_penalty: float = -0.1, max_illegal: int = 3, win_reward: float = 1.0,
                 loss_reward: float = -1.0):
        super().__init__(size=size, win_length=win_length, opening=opening, illegal=illegal,
                         illegal_penalty=illegal_penalty, max_illegal=max_illegal, win_reward=win_reward,
                         loss_reward=loss_reward)
        _int_in("size", size, 5, 15)
        _int_in("win_length", win_length, 3, size)
        _int_in("opening", opening, 0, win_length - 1)
        _int_in("max_illegal", max_illegal, 1, 10**6)
        if illegal not in DUEL_ILLEGAL:
            raise ValueError(f"env_args.illegal: {illegal!r} is not one of {DUEL_ILLEGAL}")
        for arg, value in (("illegal_penalty", illegal_penalty), ("win_reward", win_reward),
                           ("loss_reward", loss_reward)):
            _finite(arg, value)
        self.size, self.win_length, self.opening, self.illegal_mode = size, win_length, opening, illegal
        self.illegal_penalty, self.max_illegal = float(illegal_penalty), max_illegal
        self.win_reward, self.loss_reward = float(win_reward), float(loss_reward)
        self.board: list[list[str]] = []
        self.to_move, self.result = "black", "ongoing"
        self.moves: list[str] = []
        self.illegal: dict[str, int] = {}

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """{"seed", "stones": [[row, column, "X" or "O"], ...]}: the opening, a position
        of `split` (module docstring) drawn from `seed`. Raises ValueError for a split
        other than "train" or "test"."""
        check_split(split)
        held = duel_held_out(self.size, self.opening)
        pick = held.draw if held else draw
        stones = pick(self.rng(f"gomoku-duel:{split}:{seed}"),
                      lambda r: opening_stones(r, self.size, self.opening), duel_key, split)
        return {"seed": seed, "stones": stones}

    def reset(self, stones: list[list[Any]] | None = None, seed: int = 0, **_: Any) -> str:
        """Place the opening `stones`; black moves next. Raises ValueError naming
        `stones` for a stone off the board, on another, or a finished position
        (gomoku.place_stones)."""
        self.board = place_stones(self.size, stones or [], self.win_length)
        self.to_move, self.result, self.moves = "black", "ongoing", []
        self.illegal = {a: 0 for a in self.agents}
        self._rng = self.rng(f"gomoku-duel-random:{seed}:{stones}")
        return ""

    def get_agent_system_prompt(self, agent: str) -> str:
        k, n, eg = self.win_length, self.size, cell_name(self.size // 2, self.size // 2)
        me, them = self.STONE[agent], self.STONE[self.other(agent)]
        return (f"You are playing Gomoku on a {n}x{n} board as {me} against an opponent playing {them}. "
                f"Players take turns placing a stone on an empty cell; the first to get {k} stones in a "
                f"row (across, down or diagonally) wins. Columns are letters A-{chr(ord('A') + n - 1)}, "
                f"rows are numbers 1-{n}. Reply with your move as a column letter followed by a row "
                f"number, for example {eg}.")

    def get_agent_user_message(self, agent: str) -> str:
        if agent == "black":
            return self._position(agent)
        return f"You are {self.STONE[agent]}; {self.STONE['black']} moves first."

    def other(self, agent: str) -> str:
        return "white" if agent == "black" else "black"

    def _position(self, agent: str) -> str:
        eg = cell_name(self.size // 2, self.size // 2)
        return (f"{render(self.board)}\nYou are {self.STONE[agent]}; get {self.win_length} in a row. "
                f"Your move: reply with a cell such as {eg}.")

    def acting_agents(self) -> list[str]:
        return [self.to_move]

    def _info(self) -> dict[str, Any]:
        return {"result": self.result, "moves": list(self.moves), "illegal": dict(self.illegal)}

    def step_phase(self, actions: dict[str, str]) -> PhaseResult:
        """The mover's move. Raises RuntimeError when the game is over."""
        if self.result != "ongoing":
            raise RuntimeError(f"step_phase: the game is over ({self.result})")
        me, them = self.to_move, self.other(self.to_move)
        move = parse_move(actions[me], self.size)
        if isinstance(move, tuple) and self.board[move[0]][move[1]] != EMPTY:
            move = f"{cell_name(*move)} is already taken"
        penalty = 0.0
        if isinstance(move, str) and self.illegal_mode == "random":
            self.illegal[me] += 1
            penalty, said = self.illegal_penalty, f"Illegal move: {move}; a random move was played for you. "
            move = self._rng.choice(empties(self.board))
        if isinstance(move, str):
            self.illegal[me] += 1
            if self.illegal_mode == "loss" or self.illegal[me] >= self.max_illegal:
                self.result = them
                end = f"Illegal move: {move}. {self.STONE[me]} loses."
                return PhaseResult({me: end, them: f"{self.STONE[me]} made an illegal move. You win!"},
                                   {me: self.illegal_penalty + self.loss_reward, them: self.win_reward},
                                   True, self._info())
            return PhaseResult({me: f"Illegal move: {move}. Try again.\n{self._position(me)}"},
                               {me: self.illegal_penalty}, False, self._info())
        r, c = move
        self.board[r][c] = self.STONE[me]
        self.moves.append(cell_name(r, c))
        played = f"{self.STONE[me]} played {cell_name(r, c)}"
        mine = {me: penalty} if penalty else {}
        if wins_at(self.board, r, c, self.STONE[me], self.win_length):
            self.result = me
            return PhaseResult({me: f"{played}: {self.win_length} in a row. You win!",
                                them: f"{played}: {self.win_length} in a row. You lose."},
                               {me: self.win_reward + penalty, them: self.loss_reward}, True, self._info())
        if not empties(self.board):
            self.result = "draw"
            return PhaseResult({a: f"{played}. The board is full: a draw." for a in self.agents},
                               mine, True, self._info())
        self.to_move = them
        obs = {them: f"{played}.\n{self._position(them)}"}
        if penalty:
            obs[me] = said + played + "."
        return PhaseResult(obs, mine, False, self._info())


class NegotiationGame(MultiAgentGame):
    """Split a pot by simultaneous demands, for up to `rounds` rounds (the Nash demand
    game, Nash 1953, repeated with each side told the other's last demand).

    Each round both seats ("alice", "bob") name how many of the pot's coins they want,
    in the same phase. If the demands fit in the pot (sum <= pot) each gets its demand:
    reward demand / pot * discount**round, and the game ends. Otherwise each is told
    the other's demand and they try again; after the last round with no deal both get
    `no_deal_reward`. A reply without a number demands the whole pot.

    env_args:
      pot:           coins to split per game, 2..1000 (default drawn per seed from
                     6..12, so groups differ; fixed when given)
      rounds:        rounds before no deal, 1..20 (default 3)
      discount:      per-round factor on the split, (0, 1] (default 0.9)
      no_deal_reward: default 0.0

    info: result ("deal", "no_deal", "ongoing"), round, demands (by seat, last round).
    """

    name = "negotiation"
    agents = ("alice", "bob")

    def __init__(self, pot: int | None = None, rounds: int = 3, discount: float = 0.9,
                 no_deal_reward: float = 0.0):
        super().__init__(pot=pot, rounds=rounds, discount=discount, no_deal_reward=no_deal_reward)
        if pot is not None:
            _int_in("pot", pot, 2, 1000)
        _int_in("rounds", rounds, 1, 20)
        if isinstance(discount, bool) or not isinstance(discount, (int, float)) or not 0 < discount <= 1:
            raise ValueError(f"env_args.discount: must be in (0, 1], got {discount!r}")
        _finite("no_deal_reward", no_deal_reward)
        self.fixed_pot, self.rounds, self.discount = pot, rounds, float(discount)
        self.no_deal_reward = float(no_deal_reward)
        self.pot, self.round, self.result = 0, 0, "ongoing"
        self.demands: dict[str, int] = {}

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """{"pot"}: env_args.pot, else one of POTS of `split` (module docstring) drawn
        from `seed`. Raises ValueError for a split other than "train" or "test"."""
        check_split(split)
        if self.fixed_pot:
            return {"pot": self.fixed_pot}
        return {"pot": negotiation_held_out().draw(self.rng(f"negotiation:{split}:{seed}"),
                                                   lambda r: r.randint(POTS[0], POTS[-1]), negotiation_key,
                                                   split)}

    def reset(self, pot: int = 10, **_: Any) -> str:
        if isinstance(pot, bool) or not isinstance(pot, int) or not 2 <= pot <= 1000:
            raise ValueError(f"pot: must be an integer in 2..1000, got {pot!r}")
        self.pot, self.round, self.result, self.demands = pot, 0, "ongoing", {}
        return ""

    def get_agent_system_prompt(self, agent: str) -> str:
        return (f"You are {agent.capitalize()}, negotiating with "
                f"{self.other(agent).capitalize()} over how to split a pot of coins. Each round you both "
                "name how many coins you want at the same time. If the two demands fit in the pot, each "
                "gets what it asked for; if not, you both hear the other's demand and try again. "
                "Reply with a single whole number.")

    def get_agent_user_message(self, agent: str) -> str:
        return (f"The pot holds {self.pot} coins. There are {self.rounds} rounds; each round lost shrinks "
                f"the value of a deal. How many coins do you demand?")

    def other(self, agent: str) -> str:
        return "bob" if agent == "alice" else "alice"

    def acting_agents(self) -> list[str]:
        return list(self.agents)

    def _demand(self, text: str) -> int:
        m = _NUMBER.search(text)
        return self.pot if m is None else max(0, min(self.pot, int(m.group())))

    def step_phase(self, actions: dict[str, str]) -> PhaseResult:
        """One round: both demands at once. Raises RuntimeError when the game is over."""
        if self.result != "ongoing":
            raise RuntimeError(f"step_phase: the game is over ({self.result})")
        self.demands = {a: self._demand(actions[a]) for a in self.agents}
        value = self.discount ** self.round
        self.round += 1
        info = lambda: {"result": self.result, "round": self.round, "demands": dict(self.demands),  # noqa: E731
                        "pot": self.pot}
        if sum(self.demands.values()) <= self.pot:
            self.result = "deal"
            return PhaseResult({a: f"Deal: you get {self.demands[a]} of {self.pot} coins." for a in self.agents},
                               {a: self.demands[a] / self.pot * value for a in self.agents}, True, info())
        if self.round >= self.rounds:
            self.result = "no_deal"
            return PhaseResult({a: "No deal: the demands never fit in the pot." for a in self.agents},
                               {a: self.no_deal_reward for a in self.agents}, True, info())
        left = self.rounds - self.round
        return PhaseResult(
            {a: (f"No deal this round: you asked for {self.demands[a]}, {self.other(a).capitalize()} asked for "
                 f"{self.demands[self.other(a)]}, and the pot holds {self.pot}. {left} round"
                 f"{'s' if left > 1 else ''} left. How many coins do you demand?") for a in self.agents},
            {}, False, info())
