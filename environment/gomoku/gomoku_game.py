"""GomokuGame: upstream OpenTinker's Gomoku (github.com/open-tinker/OpenTinker,
opentinker/environment/gomoku/gomoku_game.py; Apache-2.0), the same game written anew:
its constructor, reward constants, move format, board text, opponent and state
generation, so a run of upstream's `gomoku_rl.py` here trains on the game it names.

The model plays X, the environment O, on a `board_size` board; `win_length` in a row
(across, down or diagonal) wins. A move is `<move>row,col</move>` (zero-based, anywhere
in the reply; the reply's `<thinking>` is free). Per step:

- a win: REWARD_WIN (10); the opponent's win after the model's move: REWARD_LOSS (-10);
  a full board: REWARD_DRAW (0); any other legal move: REWARD_VALID_MOVE (0);
- no `<move>` tag: REWARD_INVALID_FORMAT (-1); off the board or on a stone:
  REWARD_INVALID_POSITION (-1); the game goes on, and the MAX_CONSECUTIVE_INVALID_MOVES-th
  invalid move in a row ends it with REWARD_INVALID_GAME_OVER (-20);
- the `max_total_steps`-th call of `step` ends the game with REWARD_TIMEOUT (-20),
  whatever the move;
- a step after the game ended: -5, done.

The opponent: with probability OPPONENT_RANDOM_PROB (0.3) a random empty cell; else a
move that wins, else one that blocks the model's win, else the cell that most extends
its own lines (a small pull to the centre breaks ties), else one of the third of the
empty cells nearest the centre at random. Its randomness is the `random` module's, as
upstream's (the env host seeds it with the group's seed before `generate_initial_state`).

`generate_initial_state()` returns {"initial_moves": [[row, col], ...]}: with
probability `empty_board_prob` none, else up to `max_initial_moves` random cells taken
by X and O in turn (a cell that would complete a line is skipped). Standard library only.
"""

from __future__ import annotations

import random
import re
from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult

_MOVE = re.compile(r"<move>\s*(\d+)\s*,\s*(\d+)\s*</move>", re.IGNORECASE)
_LINES = ((0, 1), (1, 0), (1, 1), (1, -1))


class GomokuGame(AbstractGame):
    """Gomoku against a heuristic opponent (module docstring). Constructor as
    upstream's: `board_size` (9), `win_length` (5, at most board_size),
    `max_total_steps` (40), `max_initial_moves` (6), `empty_board_prob` (0.2)."""

    REWARD_WIN = 10.0
    REWARD_LOSS = -10.0
    REWARD_DRAW = 0.0
    REWARD_VALID_MOVE = 0.0
    REWARD_INVALID_FORMAT = -1.0
    REWARD_INVALID_POSITION = -1.0
    MAX_CONSECUTIVE_INVALID_MOVES = 100
    REWARD_INVALID_GAME_OVER = -20.0
    DEFAULT_MAX_TOTAL_STEPS = 40
    REWARD_TIMEOUT = -20.0
    OPPONENT_RANDOM_PROB = 0.3
    MAX_INITIAL_MOVES = 6
    EMPTY_BOARD_PROB = 0.2
    EMPTY, PLAYER_X, PLAYER_O = ".", "X", "O"

    def __init__(self, board_size: int = 9, win_length: int = 5, max_total_steps: int | None = None,
                 max_initial_moves: int | None = None, empty_board_prob: float | None = None):
        self.board_size = int(board_size)
        self.win_length = min(int(win_length), self.board_size)
        self.max_total_steps = max_total_steps or self.DEFAULT_MAX_TOTAL_STEPS
        self.max_initial_moves = self.MAX_INITIAL_MOVES if max_initial_moves is None else int(max_initial_moves)
        self.empty_board_prob = self.EMPTY_BOARD_PROB if empty_board_prob is None else float(empty_board_prob)
        self._init_game_state()

    def _init_game_state(self) -> None:
        self.board = [[self.EMPTY] * self.board_size for _ in range(self.board_size)]
        self.move_count = 0
        self.game_over = False
        self.winner: str | None = None
        self.last_move: tuple[int, int] | None = None
        self.consecutive_invalid_moves = 0
        self.total_step_count = 0

    # -- the episode ----------------------------------------------------------------

    def reset(self, initial_moves: list[list[int]] | None = None, **kwargs: Any) -> str:
        """A new game; `initial_moves` ([row, col] pairs) are played by X and O in turn
        (an off-board or taken cell is skipped). Returns the board."""
        self._init_game_state()
        player = self.PLAYER_X
        for move in initial_moves or []:
            if len(move) >= 2 and self._on_board(move[0], move[1]) and self.board[move[0]][move[1]] == self.EMPTY:
                self.board[move[0]][move[1]] = player
                self.move_count += 1
                player = self.PLAYER_O if player == self.PLAYER_X else self.PLAYER_X
        return self._render_board()

    def step(self, action: str) -> StepResult:
        """One move of the model's, then the opponent's (module docstring)."""
        if self.game_over:
            return StepResult(self._render_board(), -5.0, True, {"error": "Game already over"})
        self.total_step_count += 1
        if self.total_step_count >= self.max_total_steps:
            self.game_over = True
            return StepResult(f"TIMEOUT: Maximum steps ({self.max_total_steps}) reached.\n\n{self._render_board()}",
                              self.REWARD_TIMEOUT, True, {"error": "timeout", "total_steps": self.total_step_count})
        row, col = self._parse_action(action)
        invalid = self._invalid(row, col)
        if invalid is not None:
            return invalid
        self.consecutive_invalid_moves = 0
        self._place(row, col, self.PLAYER_X)
        if self._check_win(row, col, self.PLAYER_X):
            self.game_over, self.winner = True, self.PLAYER_X
            return StepResult(f"Congratulations! You win!\n\n{self._render_board()}", self.REWARD_WIN, True,
                              {"winner": "X", "move": [row, col], "board_state": self.get_state()})
        if self._full():
            return self._draw()
        r, c = self._make_env_move()
        self._place(r, c, self.PLAYER_O)
        if self._check_win(r, c, self.PLAYER_O):
            self.game_over, self.winner = True, self.PLAYER_O
            return StepResult(f"You lose! Opponent placed O at ({r},{c}).\n\n{self._render_board()}",
                              self.REWARD_LOSS, True, {"winner": "O", "env_move": [r, c]})
        if self._full():
            return self._draw()
        return StepResult(f"Opponent placed O at ({r},{c}).\n\n{self._render_board()}\n\n"
                          "Your turn (X). Analyze and provide your move:\n"
                          "<thinking>your analysis</thinking>\n<move>row,col</move>",
                          self.REWARD_VALID_MOVE, False, {"your_move": [row, col], "env_move": [r, c]})

    def _invalid(self, row: int | None, col: int | None) -> StepResult | None:
        """The StepResult of an invalid move, or None for a legal one."""
        if row is None or col is None:
            why, text, reward = ({"error": "invalid_format"}, "ERROR: Invalid move format.\n"
                                 "Use: <thinking>analysis</thinking><move>row,col</move>", self.REWARD_INVALID_FORMAT)
        elif not self._on_board(row, col):
            why = {"error": "out_of_bounds", "row": row, "col": col}
            text = (f"ERROR: Position ({row},{col}) is OUT OF BOUNDS.\nValid range: 0-{self.board_size - 1}"
                    f"\n\n{self._render_board()}")
            reward = self.REWARD_INVALID_POSITION
        elif self.board[row][col] != self.EMPTY:
            why = {"error": "occupied", "row": row, "col": col}
            text, reward = f"ERROR: Position ({row},{col}) is OCCUPIED.\n\n{self._render_board()}", \
                self.REWARD_INVALID_POSITION
        else:
            return None
        self.consecutive_invalid_moves += 1
        if self.consecutive_invalid_moves >= self.MAX_CONSECUTIVE_INVALID_MOVES:
            self.game_over = True
            return StepResult("ERROR: Too many invalid moves. Game over.", self.REWARD_INVALID_GAME_OVER, True,
                              {"error": "max_invalid_moves"})
        return StepResult(text, reward, False, why)

    def _draw(self) -> StepResult:
        self.game_over = True
        return StepResult(f"Game is a draw!\n\n{self._render_board()}", self.REWARD_DRAW, True,
                          {"winner": None, "draw": True})

    # -- prompts and state ----------------------------------------------------------

    def get_system_prompt(self) -> str:
        center = self.board_size // 2
        return (f"You are playing Gomoku (Five in a Row) on a {self.board_size}x{self.board_size} board.\n"
                f"You play as X. Your goal is to get {self.win_length} in a row.\n\n"
                "IMPORTANT: You MUST respond in the following format:\n"
                "1. First, analyze the board in <thinking></thinking> tags\n"
                "2. Then, output your move in <move>row,col</move> tags\n\n"
                f"Example: <thinking>I should take the center.</thinking><move>{center},{center}</move>")

    def get_initial_user_message(self) -> str:
        return (f"Game starts. Here's the board:\n\n{self._render_board()}\n\n"
                "Your turn (X). Provide your thinking and move:")

    def get_user_message_with_state(self, initial_moves: list[list[int]] | None = None, **kwargs: Any) -> str:
        """The opening message for a state of `generate_initial_state` (the board as
        `reset` will set it)."""
        board = GomokuGame(self.board_size, self.win_length)
        board.reset(initial_moves)
        if initial_moves:
            return f"Current board state:\n\n{board._render_board()}\n\nYour turn (X). Analyze and provide your move:"
        return (f"Game starts. Here's the empty board:\n\n{board._render_board()}\n\n"
                "You play first (X). Analyze and provide your move:")

    def get_state(self) -> dict[str, Any]:
        return {"board_array": [row[:] for row in self.board], "board_visual": self._render_board(),
                "move_count": self.move_count, "last_move": list(self.last_move) if self.last_move else None,
                "game_over": self.game_over, "winner": self.winner}

    def get_interaction_name(self) -> str:
        return "gomoku"

    def generate_initial_state(self) -> dict[str, Any]:
        """{"initial_moves": ...} drawn with `random` (module docstring)."""
        if random.random() < self.empty_board_prob:
            return {"initial_moves": []}
        n = random.randint(0, self.max_initial_moves)
        cells = [(r, c) for r in range(self.board_size) for c in range(self.board_size)]
        scratch = GomokuGame(self.board_size, self.win_length)
        moves: list[list[int]] = []
        for i, (r, c) in enumerate(random.sample(cells, min(n, len(cells)))):
            player = self.PLAYER_X if i % 2 == 0 else self.PLAYER_O
            scratch.board[r][c] = player
            if scratch._check_win(r, c, player):
                scratch.board[r][c] = self.EMPTY
            else:
                moves.append([r, c])
        return {"initial_moves": moves}

    # -- the board ------------------------------------------------------------------

    def _parse_action(self, action: str) -> tuple[int | None, int | None]:
        m = _MOVE.search(action.strip())
        return (int(m.group(1)), int(m.group(2))) if m else (None, None)

    def _on_board(self, row: int, col: int) -> bool:
        return 0 <= row < self.board_size and 0 <= col < self.board_size

    def _place(self, row: int, col: int, player: str) -> None:
        self.board[row][col] = player
        self.move_count += 1
        if player == self.PLAYER_X:
            self.last_move = (row, col)

    def _full(self) -> bool:
        return self.move_count >= self.board_size * self.board_size

    def _count_in_direction(self, row: int, col: int, dr: int, dc: int, player: str) -> int:
        n, r, c = 0, row + dr, col + dc
        while self._on_board(r, c) and self.board[r][c] == player:
            n, r, c = n + 1, r + dr, c + dc
        return n

    def _check_win(self, row: int, col: int, player: str) -> bool:
        """Whether `player`'s stone at (row, col) completes a line of win_length."""
        return any(1 + self._count_in_direction(row, col, dr, dc, player)
                   + self._count_in_direction(row, col, -dr, -dc, player) >= self.win_length for dr, dc in _LINES)

    def _wins_at(self, r: int, c: int, player: str) -> bool:
        self.board[r][c] = player
        try:
            return self._check_win(r, c, player)
        finally:
            self.board[r][c] = self.EMPTY

    def _make_env_move(self) -> tuple[int, int]:
        """The opponent's cell (module docstring)."""
        empty = [(r, c) for r in range(self.board_size) for c in range(self.board_size)
                 if self.board[r][c] == self.EMPTY]
        if random.random() < self.OPPONENT_RANDOM_PROB:
            return random.choice(empty)
        for player in (self.PLAYER_O, self.PLAYER_X):  # win, else block
            for r, c in empty:
                if self._wins_at(r, c, player):
                    return r, c
        center = self.board_size // 2
        best, best_score = None, -1.0
        for r, c in empty:
            score = sum(self._count_in_direction(r, c, dr, dc, self.PLAYER_O)
                        + self._count_in_direction(r, c, -dr, -dc, self.PLAYER_O) for dr, dc in _LINES)
            score += 0.1 / (abs(r - center) + abs(c - center) + 1)
            if score > best_score:
                best, best_score = (r, c), score
        if best is not None and best_score > 0:
            return best
        empty.sort(key=lambda cell: abs(cell[0] - center) + abs(cell[1] - center))
        return random.choice(empty[:max(1, len(empty) // 3)])

    def _render_board(self) -> str:
        """Column numbers across the top, row numbers down the side, "." for empty."""
        return "\n".join(["  " + " ".join(str(c) for c in range(self.board_size))]
                         + [f"{r} " + " ".join(self.board[r]) for r in range(self.board_size)])
