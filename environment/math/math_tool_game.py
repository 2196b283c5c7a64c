"""CodeInterpreterMathGame: upstream OpenTinker's multi-turn math game with a Python
tool (github.com/open-tinker/OpenTinker, opentinker/environment/math/math_tool_game.py;
Apache-2.0), written anew with its constructor, turn rules, observations and info.

Each reply is read in this order:

1. a `\\boxed{...}` answer ends the episode, scored against the ground truth (1.0 or
   0.0, as MathGame scores: Math-Verify, math_game.score_answer);
2. else its ```python``` (or ```py```) blocks run, each by one POST of {"code": ...}
   to `sandbox_url` (SandboxFusion's `/run_code` contract: the reply's
   `run_result.stdout` + `run_result.stderr`), and their outputs, one per line, are
   the next user message; a failed call reads as "[Error: ...]";
3. else the model is asked for code or an answer.

At the `max_turns`-th reply (0: no limit) the episode ends, scored on that reply.
The sandbox is the user's: `opentinker sandbox` serves that contract on
127.0.0.1:8000 (upstream's default `sandbox_url`) with this project's bubblewrap
sandbox (services/envhost/sandbox_server.py); a SandboxFusion server works too.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.environment.math.math_game import score_answer

_CODE = re.compile(r"```(?:python|py)\s*(.*?)```", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^}]+)\}")


class CodeInterpreterMathGame(AbstractGame):
    """Math with a Python tool run in the user's sandbox (module docstring).
    `sandbox_url` (default "http://localhost:8000/run_code"), `max_turns` (10),
    `timeout` (seconds per sandbox call, 30)."""

    REWARD_CORRECT = 1.0
    REWARD_INCORRECT = 0.0

    def __init__(self, sandbox_url: str = "http://localhost:8000/run_code", max_turns: int = 10, timeout: int = 30):
        self.sandbox_url = sandbox_url
        self.max_turns = int(max_turns)
        self.timeout = timeout
        self.code_pattern, self.boxed_pattern = _CODE, _BOXED
        self._init_game_state()

    def _init_game_state(self) -> None:
        self.ground_truth: Any = None
        self.data_source = "math"
        self.extra_info: dict[str, Any] = {}
        self.turn_count = 0
        self.game_over = False
        self.execution_history: list[dict[str, Any]] = []

    def reset(self, ground_truth: Any = None, data_source: str = "math", extra_info: dict[str, Any] | None = None,
              **kwargs: Any) -> str:
        """A new problem; returns "" (the problem is the row's prompt)."""
        self._init_game_state()
        self.ground_truth, self.data_source, self.extra_info = ground_truth, data_source, dict(extra_info or {})
        return ""

    def step(self, action: str) -> StepResult:
        if self.game_over:
            return StepResult("Game already over.", 0.0, True, {"error": "game_over"})
        self.turn_count += 1
        if self.boxed_pattern.search(action):
            self.game_over = True
            info = {"ground_truth": self.ground_truth, "data_source": self.data_source,
                    "turn_count": self.turn_count, "solution_str": action, "has_final_answer": True,
                    "execution_history": self.execution_history,
                    "code_executions_count": len(self.execution_history), **self.extra_info}
            return StepResult("", self._compute_reward(action), True, info)
        last_turn = self.max_turns > 0 and self.turn_count >= self.max_turns
        blocks = [c.strip() for c in self.code_pattern.findall(action)]
        if blocks:
            outputs = []
            for code in filter(None, blocks):
                output = self._execute_code(code)
                outputs.append(output)
                self.execution_history.append({"turn": self.turn_count, "code": code, "output": output})
            observation = "\n".join(outputs) if outputs else "Code executed (no output)"
            if last_turn:
                return self._truncated(f"{observation}\n\n[Maximum turns reached. Please provide final answer.]",
                                       action)
            return StepResult(observation, 0.0, False, {"turn_count": self.turn_count})
        if last_turn:
            return self._truncated("Maximum turns reached.", action)
        return StepResult("Please write Python code in ```python ... ``` blocks to solve the problem, or provide "
                          "your final answer in \\boxed{} format.", 0.0, False,
                          {"turn_count": self.turn_count, "no_action": True})

    def _truncated(self, observation: str, action: str) -> StepResult:
        self.game_over = True
        return StepResult(observation, self._compute_reward(action), True,
                          {"ground_truth": self.ground_truth, "turn_count": self.turn_count, "truncated": True})

    def _execute_code(self, code: str) -> str:
        """stdout + stderr of `code` run in the sandbox, or "[Error: ...]"."""
        try:
            r = httpx.post(self.sandbox_url, json={"code": code}, timeout=self.timeout)
            r.raise_for_status()
            run = r.json().get("run_result") or {}
            output = (run.get("stdout") or "") + (run.get("stderr") or "")
            return output.strip() if output.strip() else "(Code executed successfully, no output)"
        except httpx.TimeoutException:
            return "[Error: Code execution timed out]"
        except httpx.ConnectError:
            return "[Error: Cannot connect to sandbox server]"
        except Exception as e:  # the sandbox's failure is the model's observation, never a crash
            return f"[Error executing code: {e}]"

    def _compute_reward(self, solution_str: str) -> float:
        return self.REWARD_CORRECT if score_answer(solution_str, self.ground_truth) else self.REWARD_INCORRECT

    def get_system_prompt(self) -> str:
        return ("You are a helpful assistant that solves math problems using Python code.\n\n"
                "When solving problems:\n"
                "1. Think through the problem step by step\n"
                "2. Write Python code in ```python ... ``` blocks to perform calculations\n"
                "3. You can use libraries like sympy, numpy, scipy for mathematical computations\n"
                "4. After getting the result from code execution, provide your final answer in \\boxed{} format\n\n"
                "Example:\n```python\nimport sympy\nresult = sympy.simplify(sympy.sqrt(8))\nprint(result)\n```\n\n"
                "After seeing the output, write: The answer is \\boxed{2*sqrt(2)}")

    def get_initial_user_message(self) -> str:
        return "Please solve the following problem:"

    def get_state(self) -> dict[str, Any]:
        return {"ground_truth": self.ground_truth, "data_source": self.data_source, "turn_count": self.turn_count,
                "game_over": self.game_over, "execution_history": self.execution_history}

    def get_interaction_name(self) -> str:
        return "math_code_interpreter"

    def get_user_message_with_state(self, **state: Any) -> str:
        return self.get_initial_user_message()
