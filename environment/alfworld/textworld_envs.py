"""What this process's ALFWorld games share: the built-in `alfworld` env
(services/envhost/envs/alfworld.py) and upstream's ALFWorldGame (alfworld_game.py).

- TEXTWORLD_LOCK: TextWorld's PDDL backend parses its grammar and derives every text
  (feedback, each admissible command) with module-global tatsu parsers, and translates
  a game with Fast Downward's translator, which keeps its options in module globals: one
  game call (load, reset, step) at a time in a process, whichever game class makes it.
- EnvPool: a game environment holds its own copy of Fast Downward's library, which
  closing it does not free (measured: +1.1 MB a game with a new environment each, flat
  when reused), so a finished episode hands its environment to the next one, as
  ALFWorld's batch env reuses its slots.

Standard library only: TextWorld is imported by the `make` a pool is given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

TEXTWORLD_LOCK = threading.Lock()


class EnvPool:
    """Environments made by `make()`, handed out and taken back, so as many exist as
    were ever out at once. Safe from any thread."""

    def __init__(self, make: Callable[[], Any]):
        self.make = make
        self.idle: list[Any] = []
        self._lock = threading.Lock()

    def borrow(self) -> Any:
        """An idle environment, else a new one."""
        with self._lock:
            if self.idle:
                return self.idle.pop()
        return self.make()

    def give_back(self, env: Any) -> None:
        with self._lock:
            self.idle.append(env)
