"""`gomoku`: data-free, multi-turn. The model plays X against a built-in O opponent
on a small board; the first to line up `win_length` stones in a row, column or
diagonal wins.

The board is text in every message: column letters across the top, row numbers down
the side (row 1 at the top, so labels follow reading order), "." for an empty cell:

       A B C D E
     1 . . . . .
     2 . . X . .
     3 . . O . .
     4 . . . . .
     5 . . . . .

A move is a column letter and a row number ("C4", case-insensitive); the first such
token in the reply counts and the text around it is ignored.

A GRPO group shares the state from `generate_initial_state` (the opponent's seed, who
moves first, opening stones), and the opponent's random choices come from a generator
seeded by that state: episodes of a group that make the same moves see the same replies.

Held out: a problem is that whole state, (who moves first, opening position, opponent
seed), the seed a 32-bit number drawn with the rest. It belongs to one split by
`splits.split_of_key` of its key, about a fifth "test", and a group seed draws again
until its state is of the asked split, so a test game never replays a train game's
start and opponent. With the defaults (empty board, model first) the problems differ
only by the opponent's seed: against the "random" opponent that is a different game,
against "greedy" or "strong" only different tie-breaks, so use `opening` for test
positions that differ on the board.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any, Iterator

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.envhost.envs.splits import check_split, draw, split_of_key

EMPTY, MODEL, OPPONENT = ".", "X", "O"
OPPONENTS = ("random", "greedy", "strong")
FIRSTS = ("model", "opponent", "random")
ILLEGAL = ("retry", "loss")
# row, column steps of the four line directions: across, down, both diagonals
DIRECTIONS = ((0, 1), (1, 0), (1, 1), (1, -1))
# A column letter not preceded by a letter, then a row number not followed by a digit.
_MOVE = re.compile(r"(?<![A-Za-z])([A-Za-z])(\d{1,2})(?!\d)")
# Heuristic weights: each threat level is worth far more than any sum of lower ones.
_WIN, _OPEN_FOUR, _FOUR, _OPEN_THREE = 10**8, 10**6, 10**4, 10**4
_DEFENCE = 0.9  # a threat of one's own is worth a little more than blocking the same


Board = list[list[str]]


def cell_name(r: int, c: int) -> str:
    """"C4" for row index 3, column index 2 (zero-based indices, one-based rows)."""
    return f"{chr(ord('A') + c)}{r + 1}"


def parse_move(text: str, size: int) -> tuple[int, int] | str:
    """(row, column) indices of the first move token in `text`, or why there is none.

    Returns a reason string ("no move like E5 in the reply", "F12 is off the 9x9
    board") instead of raising: a bad move is the model's, not an error.
    """
    m = _MOVE.search(text)
    if m is None:
        return f"no move like {cell_name(size // 2, size // 2)} in the reply"
    c, r = ord(m.group(1).upper()) - ord("A"), int(m.group(2)) - 1
    if not (0 <= r < size and 0 <= c < size):
        return f"{m.group(1).upper()}{m.group(2)} is off the {size}x{size} board"
    return r, c


def render(board: Board) -> str:
    """The board as text: a header of column letters, then one numbered line per row."""
    size = len(board)
    head = "   " + " ".join(chr(ord("A") + c) for c in range(size))
    rows = [f"{r + 1:>2} " + " ".join(board[r]) for r in range(size)]
    return "\n".join([head, *rows])


def line_through(board: Board, r: int, c: int, who: str, dr: int, dc: int) -> tuple[int, int]:
    """(length, open ends) of the run of `who` stones through (r, c) along (dr, dc),
    counting (r, c) as `who`'s: open ends are the empty cells (0..2) at its two ends."""
    size, length, open_ends = len(board), 1, 0
    for sign in (1, -1):
        rr, cc = r + sign * dr, c + sign * dc
        while 0 <= rr < size and 0 <= cc < size and board[rr][cc] == who:
            length += 1
            rr, cc = rr + sign * dr, cc + sign * dc
        if 0 <= rr < size and 0 <= cc < size and board[rr][cc] == EMPTY:
            open_ends += 1
    return length, open_ends


def wins_at(board: Board, r: int, c: int, who: str, win_length: int) -> bool:
    """Whether a `who` stone at (r, c) makes a run of at least `win_length`."""
    return any(line_through(board, r, c, who, dr, dc)[0] >= win_length for dr, dc in DIRECTIONS)


def empties(board: Board) -> list[tuple[int, int]]:
    return [(r, c) for r, row in enumerate(board) for c, v in enumerate(row) if v == EMPTY]


def winning_cells(board: Board, who: str, win_length: int, near: tuple[int, int] | None = None
                  ) -> set[tuple[int, int]]:
    """Empty cells where a `who` stone wins at once; with `near`, only cells on the four
    lines through that cell within `win_length - 1` of it (where a stone just placed
    there can have made new ones)."""
    size = len(board)
    if near is None:
        cells = empties(board)
    else:
        r0, c0 = near
        cells = [(r0 + k * dr, c0 + k * dc) for dr, dc in DIRECTIONS
                 for k in range(1 - win_length, win_length) if k]
        cells = [(r, c) for r, c in cells
                 if 0 <= r < size and 0 <= c < size and board[r][c] == EMPTY]
    return {(r, c) for r, c in cells if wins_at(board, r, c, who, win_length)}


def threat(length: int, open_ends: int, win_length: int) -> float:
    """Heuristic worth of making a run of `length` with `open_ends` open ends."""
    if length >= win_length:
        return _WIN
    if open_ends == 0:
        return 0.0
    if length == win_length - 1:
        return _OPEN_FOUR if open_ends == 2 else _FOUR
    if length == win_length - 2 and open_ends == 2:
        return _OPEN_THREE
    return float(4**length * open_ends)


def score(board: Board, r: int, c: int, me: str, them: str, win_length: int) -> float:
    """Worth of `me` playing (r, c): the runs it makes for `me`, plus (times _DEFENCE)
    the runs it takes from `them`, over the four directions."""
    total = 0.0
    for dr, dc in DIRECTIONS:
        total += threat(*line_through(board, r, c, me, dr, dc), win_length)
        total += _DEFENCE * threat(*line_through(board, r, c, them, dr, dc), win_length)
    return total


def candidates(board: Board) -> list[tuple[int, int]]:
    """Empty cells within two steps of a stone (the centre on an empty board): far cells
    are never better, and skipping them keeps a 19x19 move fast."""
    size = len(board)
    stones = [(r, c) for r in range(size) for c in range(size) if board[r][c] != EMPTY]
    if not stones:
        return [(size // 2, size // 2)]
    near = {(r + dr, c + dc) for r, c in stones for dr in range(-2, 3) for dc in range(-2, 3)}
    return sorted((r, c) for r, c in near
                  if 0 <= r < size and 0 <= c < size and board[r][c] == EMPTY)


def opponent_move(board: Board, level: str, win_length: int, rng) -> tuple[int, int]:
    """The opponent's move (O) at `level`; ties are broken by `rng` (random.Random).

    random: a uniformly random empty cell.
    greedy: wins if it can, else blocks the model's immediate win, else plays the cell
            with the highest `score` (its own runs and the model's it blocks, weighted
            open four > four = open three > shorter runs), so it blocks open threes.
    strong: as greedy, but first looks one move deeper: it plays a move that leaves
            it two winning cells (an open four or a double four: a forced win), else
            takes the cell where the model would get two (blocking open and broken
            threes), before falling back to the greedy score.
    Raises ValueError for an unknown level.
    """
    if level == "random":
        return rng.choice(empties(board))
    if level not in OPPONENTS:
        raise ValueError(f"opponent: {level!r} is not one of {OPPONENTS}")
    cells = candidates(board)
    for who in (OPPONENT, MODEL):  # win now, else stop the model winning next move
        now = [(r, c) for r, c in cells if wins_at(board, r, c, who, win_length)]
        if now:
            return rng.choice(now)
    if level == "strong":
        for who in (OPPONENT, MODEL):  # make a double threat, else deny the model one
            forks = [(r, c) for r, c in cells if _forks(board, r, c, who, win_length)]
            if forks:
                return _best(board, forks, win_length, rng)
    return _best(board, cells, win_length, rng)


def _forks(board: Board, r: int, c: int, who: str, win_length: int) -> bool:
    board[r][c] = who
    try:
        return len(winning_cells(board, who, win_length, near=(r, c))) >= 2
    finally:
        board[r][c] = EMPTY


def _best(board: Board, cells: list[tuple[int, int]], win_length: int, rng) -> tuple[int, int]:
    scored = [(score(board, r, c, OPPONENT, MODEL, win_length), (r, c)) for r, c in cells]
    top = max(s for s, _ in scored)
    return rng.choice([cell for s, cell in scored if s == top])


class GomokuGame(AbstractGame):
    """Gomoku (k in a row) against a built-in opponent; the model plays X.

    Rewards land on the turn they happen and sum to the episode return: `win_reward`
    on the move that completes the model's row, `loss_reward` when the opponent
    completes one (or the model runs out of illegal moves), `draw_reward` when the
    board fills, `illegal_penalty` on every illegal move, 0.0 otherwise.

    Illegal moves (no move token, off the board, an occupied cell): with
    illegal="retry" the model is told why and asked again, and its `max_illegal`-th
    illegal move loses the game (that turn gets illegal_penalty + loss_reward); with
    illegal="loss" the first one loses at once (loss_reward).

    env_args:
      size:            board side, 5..19 (default 9)
      win_length:      stones in a row that win, 3..size (default 5)
      opponent:        "random" (default: a model can learn to beat it), "greedy" or
                       "strong"; see `opponent_move`
      first:           who moves first: "model" (default), "opponent", or "random"
                       (drawn per seed, so a group shares it)
      opening:         stone pairs (one X, one O) placed at random near the centre
                       per seed, 0..win_length-1 (default 0), so games start apart
      illegal:         "retry" (default) or "loss"
      illegal_penalty: reward of an illegal move under "retry" (default -0.1)
      max_illegal:     illegal moves that lose the game under "retry" (default 3)
      win_reward, draw_reward, loss_reward: defaults 1.0, 0.0, -1.0
      legal_reward:    added to the reward of each turn that plays a legal move (default
                       0.0): a format reward (as DeepSeek-R1's, arXiv 2501.12948) for a
                       model that rarely names a cell at first, whose games all end in
                       the same illegal-move loss, so a GRPO group has no reward spread

    info (every step): result ("win", "loss", "draw", "ongoing"), moves (the game's
    moves so far, e.g. ["E5", "F6"], opening stones excluded), illegal (count); on an
    illegal move also illegal_reason.

    Raises ValueError naming the env_arg for a bad value, TypeError for an unknown one.
    """

    name = "gomoku"

    def __init__(self, size: int = 9, win_length: int = 5, opponent: str = "random",
                 first: str = "model", opening: int = 0, illegal: str = "retry",
                 illegal_penalty: float = -0.1, max_illegal: int = 3, win_reward: float = 1.0,
                 draw_reward: float = 0.0, loss_reward: float = -1.0, legal_reward: float = 0.0):
        super().__init__(size=size, win_length=win_length, opponent=opponent, first=first,
                         opening=opening, illegal=illegal, illegal_penalty=illegal_penalty,
                         max_illegal=max_illegal, win_reward=win_reward,
                         draw_reward=draw_reward, loss_reward=loss_reward, legal_reward=legal_reward)
        _int_in("size", size, 5, 19)
        _int_in("win_length", win_length, 3, size)
        _int_in("opening", opening, 0, win_length - 1)
        _int_in("max_illegal", max_illegal, 1, 10**6)
        for arg, value, allowed in (("opponent", opponent, OPPONENTS), ("first", first, FIRSTS),
                                    ("illegal", illegal, ILLEGAL)):
            if value not in allowed:
                raise ValueError(f"env_args.{arg}: {value!r} is not one of {allowed}")
        for arg, value in (("illegal_penalty", illegal_penalty), ("win_reward", win_reward),
                           ("draw_reward", draw_reward), ("loss_reward", loss_reward),
                           ("legal_reward", legal_reward)):
            _finite(arg, value)
        self.size, self.win_length, self.level = size, win_length, opponent
        self.first, self.opening, self.illegal_mode = first, opening, illegal
        self.max_illegal = max_illegal
        self.illegal_penalty, self.win_reward = float(illegal_penalty), float(win_reward)
        self.draw_reward, self.loss_reward = float(draw_reward), float(loss_reward)
        self.legal_reward = float(legal_reward)
        self.board: Board = []
        self.moves: list[str] = []
        self.illegal, self.result = 0, "ongoing"
        self.opened = ""  # the opponent's first move, when it moves first
        self._rng = self.rng(0)

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """{"seed", "first", "stones"}: the opponent's seed, who moves first ("model" or
        "opponent") and the opening stones as [row, column, "X" or "O"] (zero-based),
        a state of `split` (module docstring) drawn from `seed`.

        Raises ValueError for a split other than "train" or "test".
        """
        check_split(split)

        def make(rng) -> dict[str, Any]:
            first = rng.choice(FIRSTS[:2]) if self.first == "random" else self.first
            stones = opening_stones(rng, self.size, self.opening)
            return {"seed": rng.getrandbits(32), "first": first, "stones": stones}

        return draw(self.rng(f"gomoku:{split}:{seed}"), make, problem_key, split)

    def reset(self, seed: int = 0, first: str | None = None,
              stones: list[list[Any]] | None = None) -> str:
        """Start from the state (`stones` as [row, column, "X" or "O"]); when the
        opponent moves first it moves here. Returns "": the board is in the initial
        user message.

        Raises ValueError naming `stones` or `first` for a bad position.
        """
        first = first or ("model" if self.first == "random" else self.first)
        if first not in FIRSTS[:2]:
            raise ValueError(f"first: {first!r} is not one of {FIRSTS[:2]}")
        self.board = place_stones(self.size, stones or [], self.win_length)
        self._rng = self.rng(f"gomoku-opponent:{seed}")
        self.moves, self.illegal, self.result, self.opened = [], 0, "ongoing", ""
        if first == "opponent":
            r, c = opponent_move(self.board, self.level, self.win_length, self._rng)
            self.board[r][c] = OPPONENT
            self.moves.append(cell_name(r, c))
            self.opened = f"The opponent (O) opened with {cell_name(r, c)}.\n"
        return ""

    def get_system_prompt(self) -> str:
        k, n, eg = self.win_length, self.size, cell_name(self.size // 2, self.size // 2)
        last = chr(ord("A") + n - 1)
        return (f"You are playing Gomoku on a {n}x{n} board as X against an opponent playing O. "
                f"Players take turns placing a stone on an empty cell; the first to get {k} "
                f"stones in a row (across, down or diagonally) wins. Columns are letters A-{last}, "
                f"rows are numbers 1-{n}. Reply with your move as a column letter followed by a "
                f"row number, for example {eg}.")

    def get_initial_user_message(self) -> str:
        return f"{self.opened}{self._position()}"

    def _position(self) -> str:
        eg = cell_name(self.size // 2, self.size // 2)
        return (f"{render(self.board)}\nYou are X; get {self.win_length} in a row. "
                f"Your move: reply with a cell such as {eg}.")

    def _info(self, **extra: Any) -> dict[str, Any]:
        return {"result": self.result, "moves": list(self.moves), "illegal": self.illegal, **extra}

    def _end(self, result: str, said: str, reward: float, **extra: Any) -> StepResult:
        self.result = result
        return StepResult(f"{said}\n{render(self.board)}", reward, True, self._info(**extra))

    def step(self, action: str) -> StepResult:
        """Play the model's move, then the opponent's reply.

        Raises RuntimeError when the game is already over.
        """
        if self.result != "ongoing":
            raise RuntimeError(f"step: the game is over ({self.result})")
        move = parse_move(action, self.size)
        if isinstance(move, tuple) and self.board[move[0]][move[1]] != EMPTY:
            move = f"{cell_name(*move)} is already taken"
        if isinstance(move, str):
            return self._illegal(move)
        r, c = move
        self.board[r][c] = MODEL
        self.moves.append(cell_name(r, c))
        said, legal = f"You played {cell_name(r, c)}", self.legal_reward
        if wins_at(self.board, r, c, MODEL, self.win_length):
            return self._end("win", f"{said} and made {self.win_length} in a row. You win!",
                             self.win_reward + legal)
        if not empties(self.board):
            return self._end("draw", f"{said}. The board is full: a draw.", self.draw_reward + legal)
        r, c = opponent_move(self.board, self.level, self.win_length, self._rng)
        self.board[r][c] = OPPONENT
        self.moves.append(cell_name(r, c))
        said += f". The opponent (O) played {cell_name(r, c)}"
        if wins_at(self.board, r, c, OPPONENT, self.win_length):
            return self._end("loss", f"{said} and made {self.win_length} in a row. You lose.",
                             self.loss_reward + legal)
        if not empties(self.board):
            return self._end("draw", f"{said}. The board is full: a draw.", self.draw_reward + legal)
        return StepResult(f"{said}.\n{self._position()}", legal, False, self._info())

    def _illegal(self, reason: str) -> StepResult:
        self.illegal += 1
        if self.illegal_mode == "loss":
            return self._end("loss", f"Illegal move: {reason}. You lose.", self.loss_reward,
                             illegal_reason=reason)
        if self.illegal >= self.max_illegal:
            return self._end("loss", f"Illegal move: {reason}. That is {self.illegal} illegal "
                             "moves: you lose.", self.illegal_penalty + self.loss_reward,
                             illegal_reason=reason)
        left = self.max_illegal - self.illegal
        return StepResult(f"Illegal move: {reason}. Try again ({left} more illegal "
                          f"move{'s' if left > 1 else ''} and you lose).\n{self._position()}",
                          self.illegal_penalty, False, self._info(illegal_reason=reason))


def problem_key(state: dict[str, Any]) -> str:
    """The canonical key of a GomokuGame state: who moves first, the position, the seed."""
    return f"gomoku:{state['first']}:{opening_key(state['stones'])}:{state['seed']}"


def split_of(state: dict[str, Any]) -> str:
    """Which split a GomokuGame state belongs to (`splits.split_of_key`)."""
    return split_of_key(problem_key(state))


def opening_cells(size: int, opening: int) -> list[tuple[int, int]]:
    """The cells opening stones go on: the 5x5 square around the centre, or the whole
    board when that cannot hold 2 * `opening` stones."""
    lo, hi = max(0, size // 2 - 2), min(size - 1, size // 2 + 2)
    centre = [(r, c) for r in range(lo, hi + 1) for c in range(lo, hi + 1)]
    if len(centre) < 2 * opening:  # a long opening for a long win_length
        centre = [(r, c) for r in range(size) for c in range(size)]
    return centre


def opening_stones(rng, size: int, opening: int) -> list[list[Any]]:
    """`opening` stone pairs ([row, column, "X"], then [row, column, "O"], ...) on
    distinct `opening_cells`, drawn from `rng`."""
    picked = rng.sample(opening_cells(size, opening), 2 * opening)
    return [[r, c, MODEL if i % 2 == 0 else OPPONENT] for i, (r, c) in enumerate(picked)]


def opening_key(stones: list[list[Any]]) -> str:
    """The position `stones` make, whatever their order: "X:r,c;r,c|O:r,c"."""
    return _position_key([(r, c) for r, c, who in stones if who == MODEL],
                         [(r, c) for r, c, who in stones if who != MODEL])


def opening_count(size: int, opening: int) -> int:
    """How many positions `opening_stones` can give: X cells, then O cells among the rest."""
    n = len(opening_cells(size, opening))
    return math.comb(n, opening) * math.comb(n - opening, opening)


def opening_keys(size: int, opening: int) -> Iterator[str]:
    """The `opening_key` of every position `opening_stones` can give (`opening_count` of them)."""
    cells = opening_cells(size, opening)
    for xs in itertools.combinations(cells, opening):
        rest = [cell for cell in cells if cell not in xs]
        for os_ in itertools.combinations(rest, opening):
            yield _position_key(list(xs), list(os_))


def _position_key(xs: list[tuple[int, int]], os_: list[tuple[int, int]]) -> str:
    def cells(group: list[tuple[int, int]]) -> str:
        return ";".join(f"{r},{c}" for r, c in sorted(group))

    return f"X:{cells(xs)}|O:{cells(os_)}"


def place_stones(size: int, stones: list[Any], win_length: int) -> Board:
    """A `size` board holding `stones` ([row, column, "X" or "O"], zero-based).

    Raises ValueError naming `stones` for a malformed stone, one off the board or on
    another, a position that is already won, or a full board.
    """
    board = [[EMPTY] * size for _ in range(size)]
    for stone in stones:
        if not (isinstance(stone, (list, tuple)) and len(stone) == 3):
            raise ValueError(f"stones: {stone!r} is not [row, column, 'X' or 'O']")
        r, c, who = stone
        if not (isinstance(r, int) and isinstance(c, int) and 0 <= r < size
                and 0 <= c < size and who in (MODEL, OPPONENT)):
            raise ValueError(f"stones: {stone!r} is not [row, column, 'X' or 'O'] on the board")
        if board[r][c] != EMPTY:
            raise ValueError(f"stones: two stones on {cell_name(r, c)}")
        board[r][c] = who
    for r, c, who in stones:
        if wins_at(board, r, c, who, win_length):
            raise ValueError(f"stones: {who} already has {win_length} in a row")
    if not empties(board):
        raise ValueError("stones: the board is full")
    return board


def _finite(arg: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"env_args.{arg}: must be a finite number, got {value!r}")


def _int_in(arg: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"env_args.{arg}: must be an integer in {lo}..{hi}, got {value!r}")
