"""`code-math`: multi-turn math word problems where the model may run Python.

Each turn the model either runs code (a `python` tool call, or a ```python block),
and sees what it printed, or gives its final answer (`#### <number>` or `\\boxed{...}`),
which ends the episode. Code runs in `sandbox.run_python`: a fresh bubblewrap sandbox
per run, no network, no host files, bounded time and memory.

Problems come from GSM8K (data prepared by `opentinker data gsm8k`, read with the
`gsm8k` env's loader) or, with `source="arith"`, are generated from the seed
(a `digits`-digit times a `digits_b`-digit number, held out by the `arith` env's split
rule).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.envhost import sandbox
from opentinker.services.envhost.envs import gsm8k
from opentinker.services.envhost.envs.answers import verify_answer
from opentinker.services.envhost.envs.arith import _range, split_of
from opentinker.services.envhost.envs.toolcall import tool_calls

SOURCES = ("gsm8k", "arith")
TOOL_NAME = "python"
# a tenant's env_args never size one sandboxed run (or an episode's runs) beyond these
MAX_MEMORY_MB = 8192
MAX_TOOL_CALLS = 1024

# A fence with no language, or python/py; its body runs up to the closing fence.
_FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_MARK = "####"

TOOLS = [{
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": ("Run Python 3 code in a fresh sandbox (no network, no files or "
                        "variables kept between runs) and return what it prints to stdout "
                        "and stderr. Use print() to see values; sympy and numpy are available."),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python source to run"}},
            "required": ["code"],
        },
    },
}]


# the one-shot demonstration (env_args.example): a problem of neither split's form
EXAMPLE = ("\n\nExample.\nUser: What is 1.5 * 2.5?\nAssistant: ```python\nprint(1.5 * 2.5)\n```\n"
           "User: 3.75\nAssistant: #### 3.75")


def _correct(text: str, answer: str) -> tuple[str, bool]:
    """(the answer a final reply gives, whether it equals `answer`), by the same
    Math-Verify check as gsm8k (answers.verify_answer): after the last `####`, else a
    `\\boxed{}`, else the reply's last expression."""
    correct, got = verify_answer(text, answer)
    return got, correct


def parse_action(action: str) -> tuple[str | None, str | None, str]:
    """Split a model turn into (code to run or None, final-answer text or None, error).

    Code is every `python` tool call, then every fenced block, joined into one
    program. A final answer is a `####` line or `\\boxed{}` outside the code. `error`
    says what was wrong with a tool call that could not be read ("" if none).
    """
    # Fences are looked for outside tool calls, so one inside a call's JSON string is
    # not run twice, and a final answer only outside any code.
    pieces, errors, prose = tool_calls(action, TOOL_NAME, "code",
                                       'the python tool needs {"arguments": {"code": "<python source>"}}')
    pieces += _FENCE.findall(prose)
    prose = _FENCE.sub("", prose)
    code = "\n\n".join(pieces) if pieces else None
    final = prose if (_MARK in prose or _BOXED.search(prose)) else None
    return code, final, "; ".join(errors)


class CodeMathGame(AbstractGame):
    """A math problem solved with up to `max_tool_calls` sandboxed Python runs.

    Reward 1.0 on the turn a correct final answer is given, 0.0 otherwise. A turn with
    code (and no final answer) runs it and returns its output (done False); a turn
    with neither gets a reminder of the format; a code turn past `max_tool_calls`
    ends the episode with reward 0.

    env_args:
      source:         "gsm8k" (default; needs `opentinker data gsm8k`) or "arith"
      data_dir:       GSM8K Parquet folder (default <OPENTINKER_HOME>/data/gsm8k)
      split:          if set, every episode uses this split, whatever the request's
      digits:         arith only: digits of the first factor, 1..9 (default 3)
      digits_b:       arith only: digits of the second factor, 1..9 (default: `digits`)
      example:        show one worked exchange (code, its output, the final answer) in
                      the system prompt (default False), a one-shot demonstration of the
                      format for a small model (Brown et al. 2020, arXiv 2005.14165)
      max_tool_calls: code runs allowed per episode, 0..1024 (default 4)
      timeout_s:      wall clock of one run, seconds, (0, 60] (default 5)
      memory_mb:      address space of one run, MiB, 64..8192 (default 512)

    Raises ValueError naming the env_arg for a bad value.
    """

    name = "code-math"

    def __init__(self, source: str = "gsm8k", data_dir: str | None = None,
                 split: str | None = None, digits: int = 3, max_tool_calls: int = 4,
                 timeout_s: float = 5.0, memory_mb: int = 512, digits_b: int | None = None,
                 example: bool = False):
        super().__init__(source=source, data_dir=data_dir, split=split, digits=digits,
                         max_tool_calls=max_tool_calls, timeout_s=timeout_s, memory_mb=memory_mb,
                         digits_b=digits_b, example=example)
        if source not in SOURCES:
            raise ValueError(f"env_args.source: {source!r} is not one of {SOURCES}")
        if split is not None and split not in gsm8k.SPLITS:
            raise ValueError(f"env_args.split: {split!r} is not one of {gsm8k.SPLITS}")
        for field, d in (("digits", digits), ("digits_b", digits if digits_b is None else digits_b)):
            if not _is_int(d) or not 1 <= d <= 9:
                raise ValueError(f"env_args.{field}: must be an integer in 1..9, got {d!r}")
        if not _is_int(max_tool_calls) or not 0 <= max_tool_calls <= MAX_TOOL_CALLS:
            raise ValueError(f"env_args.max_tool_calls: must be an integer in 0..{MAX_TOOL_CALLS}, "
                             f"got {max_tool_calls!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not 0 < timeout_s <= 60:
            raise ValueError(f"env_args.timeout_s: must be a number in (0, 60], got {timeout_s!r}")
        if not _is_int(memory_mb) or not 64 <= memory_mb <= MAX_MEMORY_MB:
            raise ValueError(f"env_args.memory_mb: must be an integer in 64..{MAX_MEMORY_MB}, got {memory_mb!r}")
        if not isinstance(example, bool):
            raise ValueError(f"env_args.example: must be true or false, got {example!r}")
        self.source, self.split, self.example = source, split, example
        self.digits, self.digits_b = digits, digits if digits_b is None else digits_b
        self.data_dir = Path(data_dir) if data_dir else gsm8k.default_data_dir()
        self.max_tool_calls = max_tool_calls
        # CPU seconds a little above the wall clock, so a busy loop ends as "timed out"
        # rather than racing SIGXCPU.
        self.limits = sandbox.SandboxLimits(timeout_s=float(timeout_s), memory_mb=memory_mb,
                                            cpu_s=math.ceil(timeout_s) + 1)
        self.question, self.answer = "", ""
        self.tool_calls = 0
        self.exit_code: int | None = None  # of the last run
        self.timed_out = False  # the last run

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """GSM8K: {"index", "split"}, a row of `split` chosen by `seed`. arith:
        {"question", "answer"}, a `digits`-digit times a `digits_b`-digit number from `split`."""
        split = self.split or split
        if split not in gsm8k.SPLITS:
            raise ValueError(f"split: {split!r} is not one of {gsm8k.SPLITS}")
        rng = self.rng(f"code-math:{self.source}:{split}:{seed}")
        if self.source == "gsm8k":
            questions, _ = gsm8k.load_split(self.data_dir, split)
            return {"index": rng.randrange(len(questions)), "split": split}
        ra, rb = _range(self.digits), _range(self.digits_b)
        for _ in range(1000):  # ~5 draws for "test" (see arith.split_of)
            a, b = rng.randint(*ra), rng.randint(*rb)
            if split_of("mul", a, b) == split:
                return {"question": f"What is {a} * {b}?", "answer": str(a * b)}
        raise ValueError(f"split: no {split!r} problem with {self.digits}- and {self.digits_b}-digit factors")

    def reset(self, index: int | None = None, split: str = "train", question: str | None = None,
              answer: str | None = None, seed: int | None = None) -> str:
        """Start on a GSM8K row (`index`, `split`), a given `question` and `answer`, or
        the problem of `seed`. Returns ""; the question is the initial user message.

        Raises SandboxUnavailable when code could not run on this host (no bwrap).
        """
        sandbox.check()
        if question is None and index is None:
            state = self.generate_initial_state(seed or 0, split)
            return self.reset(**state)
        if question is not None:
            if answer is None:
                raise ValueError("answer: required with question")
            self.question, self.answer = str(question), str(answer)
        else:
            split = self.split or split
            questions, finals = gsm8k.load_split(self.data_dir, split)
            if not 0 <= index < len(questions):
                raise ValueError(f"index: {index} is outside 0..{len(questions) - 1} of split {split!r}")
            self.question, self.answer = questions[index], finals[index]
        self.tool_calls, self.exit_code, self.timed_out = 0, None, False
        return ""

    def get_system_prompt(self) -> str:
        return (
            "Solve the math problem. You may run Python to compute: call the `python` tool "
            "with your code, or write the code in a ```python block, and the next message "
            "will show what it printed. Use print() for every value you need. Each run "
            f"starts fresh, has {self.limits.timeout_s:g} s, and may import sympy and "
            f"numpy; you can run code up to {self.max_tool_calls} times. When you know the "
            "answer, write it on its own last line as '#### <number>'." + (EXAMPLE if self.example else ""))

    def get_initial_user_message(self) -> str:
        return self.question

    def get_tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def step(self, action: str) -> StepResult:
        code, final, error = parse_action(action)
        info: dict[str, Any] = {"tool_calls": self.tool_calls, "exit_code": self.exit_code,
                                "timed_out": self.timed_out, "answer": self.answer, "parsed": None,
                                "correct": False}
        if final is not None:
            got, correct = _correct(final, self.answer)
            info.update(parsed=got, correct=correct, ended="answer")
            return StepResult("", 1.0 if correct else 0.0, True, info)
        if code is None:
            why = f"Your tool call could not be run: {error}. " if error else ""
            return StepResult(
                why + "Run Python with the `python` tool or a ```python block (print the "
                "values you need), or give the final answer on its own last line as "
                "'#### <number>'.", 0.0, False, info)
        if self.tool_calls >= self.max_tool_calls:
            info["ended"] = f"max_tool_calls: all {self.max_tool_calls} code runs were used"
            return StepResult(f"No code runs left ({self.max_tool_calls} used); the episode is over.",
                              0.0, True, info)
        result = sandbox.run_python(code, self.limits)
        self.tool_calls += 1
        self.exit_code, self.timed_out = result.exit_code, result.timed_out
        info.update(tool_calls=self.tool_calls, exit_code=result.exit_code,
                    timed_out=result.timed_out)
        obs = result.observation()
        if self.tool_calls == self.max_tool_calls:
            obs += "\n[That was your last code run: give the final answer as '#### <number>'.]"
        return StepResult(obs, 0.0, False, info)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
