"""`geometry3k` / `geometry3k-tool`: geometry problems with a diagram (vision-language).

Geometry3K (Lu et al., Inter-GPS, ACL 2021, arXiv 2105.04165): each problem is a text
and a diagram; the diagram is the first user message's image (`get_initial_images`).
`geometry3k` is single-turn; `geometry3k-tool` lets the model call a `calculator` tool
(a Hermes/Qwen `<tool_call>` or a ```calc / ```python block) before it answers. Either
way the answer is the reply's last `\\boxed{}`, graded by `grade`: equal to the gold
answer as a number within 1% ("2\\sqrt{3}", "3.46", "\\frac{7}{2}", "10\\pi"), else as
normalized text.

Data (env arg `data_dir`, else $GEOMETRY3K_DATA, else the shipped 24 + 8 problem
sample in envs/data/geometry3k, made by scripts/make_geometry3k_sample.py), one split
per file set, in any of these layouts:
- Parquet as distributed for VLM RL (hiyouga/geometry3k, as used by verl and EasyR1):
  `<split>.parquet` or `<split>-*.parquet`, in the folder or its `data/`; columns
  `problem` (text with an `<image>` marker), `answer`, `images` (a list of
  `{"bytes": ..., "path": ...}`)
- JSON lines `<split>.jsonl`: the same fields, `images` as file paths relative to the folder
- Inter-GPS's own release: `<split>/<id>/data.json` (`problem_text`, `choices`, `answer`
  as a choice letter) and `<split>/<id>/img_diagram.png`; the answer is the chosen
  choice's text; the validation split's folder is `val`
Splits: train, validation, test; a job's `train` and `test` splits read those files, so
the test problems are the dataset's own held-out ones: 601 in Geometry3K (2,101 train,
300 validation; arXiv 2105.04165), 8 in the shipped sample.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.envhost.envs.toolcall import tool_calls

SPLITS = ("train", "validation", "test")
SAMPLE_DIR = Path(__file__).resolve().parent / "data" / "geometry3k"
DATA_ENV_VAR = "GEOMETRY3K_DATA"
IMAGE_MARKER = "<image>"
#: relative tolerance of a numeric answer (gold answers are often rounded, "14.5")
REL_TOL = 1e-2
TOOL_NAME = "calculator"
#: calculator limits: expression length, syntax-tree size, |exponent|, calls in one turn
MAX_EXPRESSION_CHARS = 500
MAX_NODES = 200
MAX_EXPONENT = 1000
MAX_CALLS_PER_TURN = 16

SYSTEM_PROMPT = ("You are given a geometry problem and its diagram. Reason step by step, "
                 "then put the final answer in \\boxed{}, e.g. \\boxed{2\\sqrt{3}} or \\boxed{14.5}.")

TOOLS = [{
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": ("Evaluate an arithmetic expression and return its value. Numbers, "
                        "+ - * / % ** (or ^), parentheses, pi, e, and sqrt, sin, cos, tan, asin, "
                        "acos, atan (radians), radians, degrees, log, exp, abs."),
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. sqrt(3**2 + 4**2)"}},
            "required": ["expression"],
        },
    },
}]


@dataclass(frozen=True)
class Problem:
    """One row: the problem text (with its `<image>` marker), the gold answer, and its
    images (file bytes, or the path of an image file)."""

    problem: str
    answer: str
    images: tuple[bytes | Path, ...]


# ---- data ------------------------------------------------------------------------

def default_data_dir() -> Path:
    """$GEOMETRY3K_DATA when set, else the shipped sample."""
    return Path(os.environ.get(DATA_ENV_VAR) or SAMPLE_DIR)


def _image_ref(item: Any, base: Path, where: str) -> bytes | Path:
    if isinstance(item, dict):
        if item.get("bytes"):
            return bytes(item["bytes"])
        item = item.get("path")
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    if isinstance(item, str) and item:
        return base / item  # an absolute path stays absolute
    raise ValueError(f"{where}: an image is {{'bytes': ...}}, {{'path': ...}} or a path, got {item!r:.80}")


def _row(rec: Any, base: Path, where: str) -> Problem:
    try:
        problem, answer, images = rec["problem"], rec["answer"], rec["images"]
    except (KeyError, TypeError):
        raise ValueError(f"{where}: a row needs problem, answer and images") from None
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"{where}: images must be a list, got {type(images).__name__}")
    return Problem(str(problem), str(answer), tuple(_image_ref(x, base, where) for x in images))


def _read_parquet(files: list[Path], base: Path) -> list[Problem]:
    import pyarrow.parquet as pq

    rows = []
    for f in files:
        t = pq.read_table(f)
        missing = {"problem", "answer", "images"} - set(t.column_names)
        if missing:
            raise ValueError(f"{f}: no column {', '.join(sorted(missing))} (has {t.column_names})")
        for i, rec in enumerate(t.select(["problem", "answer", "images"]).to_pylist()):
            rows.append(_row(rec, base, f"{f} row {i}"))
    return rows


def _read_jsonl(path: Path) -> list[Problem]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not JSON ({e})") from None
                rows.append(_row(rec, path.parent, f"{path}:{lineno}"))
    return rows


def _read_intergps(folder: Path) -> list[Problem]:
    rows = []
    ids = sorted((d for d in folder.iterdir() if (d / "data.json").exists()),
                 key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))
    for d in ids:
        where = str(d / "data.json")
        rec = json.loads((d / "data.json").read_text(encoding="utf-8"))
        try:
            text, choices, letter = rec["problem_text"], rec["choices"], rec["answer"]
            answer = choices["ABCDEFGH".index(str(letter).strip().upper())]
        except (KeyError, TypeError, ValueError, IndexError):
            raise ValueError(f"{where}: needs problem_text, choices and answer (a letter naming "
                             "one of the choices)") from None
        rows.append(Problem(IMAGE_MARKER + str(text), str(answer), (d / "img_diagram.png",)))
    return rows


def read_split(data_dir: str | Path, split: str) -> list[Problem]:
    """Every problem of `split` in `data_dir`, from the first layout found (module
    docstring): Parquet, then `<split>.jsonl`, then Inter-GPS folders.

    Raises ValueError for an unknown split or a malformed row (naming file and row),
    FileNotFoundError when the folder has no such split or the split is empty.
    """
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {SPLITS}")
    root = Path(data_dir)
    for folder in (root, root / "data"):
        files = sorted({*folder.glob(f"{split}.parquet"), *folder.glob(f"{split}-*.parquet")})
        if files:
            rows = _read_parquet(files, root)
            break
    else:
        if (root / f"{split}.jsonl").exists():
            rows = _read_jsonl(root / f"{split}.jsonl")
        else:
            names = ("val", "validation") if split == "validation" else (split,)
            found = [root / n for n in names if (root / n).is_dir()]
            if not found:
                raise FileNotFoundError(
                    f"data_dir {root}: no {split!r} split (looked for {split}.parquet, {split}-*.parquet "
                    f"(also under data/), {split}.jsonl and Inter-GPS folders {'/'.join(names)}/<id>/data.json)")
            rows = _read_intergps(found[0])
    if not rows:
        raise FileNotFoundError(f"data_dir {root}: the {split!r} split has no problems")
    return rows


_cache: dict[tuple[str, str], list[Problem]] = {}
_cache_lock = threading.Lock()


def load_split(data_dir: str | Path, split: str) -> list[Problem]:
    """`read_split`, once per process and folder (envhost threads share it)."""
    key = (str(Path(data_dir).resolve()), split)
    with _cache_lock:
        if key not in _cache:
            _cache[key] = read_split(key[0], split)
        return _cache[key]


# ---- the calculator --------------------------------------------------------------

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {name: getattr(math, name) for name in
          ("sqrt", "sin", "cos", "tan", "asin", "acos", "atan", "radians", "degrees", "log", "exp")}
_FUNCS["abs"] = abs
_CONSTS = {"pi": math.pi, "e": math.e}


def calculate(expression: str) -> float:
    """The value of an arithmetic expression, by walking its syntax tree (nothing is
    executed): numbers, + - * / % ** (`^` is read as **), parentheses, `pi`, `e`, and the
    one-argument functions sqrt, sin, cos, tan, asin, acos, atan (radians), radians,
    degrees, log (natural), exp, abs; a `math.` prefix is allowed.

    Raises ValueError saying what is wrong: syntax, a name or construct that is not
    arithmetic, more than MAX_EXPRESSION_CHARS characters or MAX_NODES tree nodes, an
    exponent beyond +-MAX_EXPONENT, division by zero, a math domain error, or a result
    that is not a finite number.
    """
    text = expression.strip().replace("^", "**").replace("math.", "").replace("π", "pi")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression has {len(text)} characters; at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ValueError(f"the expression is too long (more than {MAX_NODES} parts)")
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large") from None
    if not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    return value


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent {right:g} is beyond +-{MAX_EXPONENT}")
        value = _BINOPS[type(node.op)](left, right)
        if isinstance(value, complex):  # (-8) ** (1/3)
            raise ValueError("the result is not a real number")
        return value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
        if len(node.args) != 1 or node.keywords:
            raise ValueError(f"{node.func.id}() takes one argument")
        arg = _eval(node.args[0])
        try:
            return float(_FUNCS[node.func.id](arg))
        except ValueError:
            raise ValueError(f"math domain error: {node.func.id}({arg:g})") from None
    if isinstance(node, ast.Name):
        raise ValueError(f"unknown name {node.id!r}: only pi, e and {', '.join(_FUNCS)}() are known")
    if isinstance(node, ast.Constant):
        raise ValueError(f"{node.value!r} is not a number")
    if isinstance(node, ast.Call):
        raise ValueError(f"only the functions {', '.join(_FUNCS)} can be called")
    raise ValueError(f"{type(node).__name__} is not allowed: only numbers, + - * / % **, "
                     "parentheses and the listed functions")


def format_number(x: float) -> str:
    """A result as the calculator shows it: integers without a point, else 10
    significant digits (3.0 -> "3", 2*sqrt(3) -> "3.464101615")."""
    if x == round(x) and abs(x) < 1e15:
        return str(int(round(x)))
    return f"{x:.10g}"


# ---- grading ---------------------------------------------------------------------

def boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces
    matched ("\\boxed{\\frac{\\sqrt{3}}{2}}" gives "\\frac{\\sqrt{3}}{2}"); None if none."""
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*\{", text))):
        depth, start = 1, m.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


_UNITS = re.compile(r"\\(?:text|mathrm|mbox|operatorname)\s*\{[^{}]*\}")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°")


def _clean(text: str) -> str:
    s = _UNITS.sub("", text)
    s = _DEGREES.sub("", s)
    for junk in ("$", "\\left", "\\right", "\\,", "\\;", "\\!", "\\ ", "~"):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\approx", "=")
    s = s.rsplit("=", 1)[-1]  # "x = 5" -> "5"
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands: 1,200
    return "".join(s.split()).rstrip(".")


def _group(s: str, i: int) -> tuple[str | None, int]:
    """The argument of a LaTeX command at `s[i]`: a {braced} group or one character."""
    if i >= len(s):
        return None, i
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j], j + 1
    return None, i


def latex_to_expression(s: str) -> str | None:
    """Simple LaTeX arithmetic as a `calculate` expression: \\frac{a}{b}, \\sqrt{x},
    \\sqrt[n]{x}, \\pi, \\cdot, \\times, \\div, ^, braces, implied products
    ("2\\sqrt{3}" -> "2*sqrt(3)"). None for anything else (another command, stray braces)."""
    out: list[str] = []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            m = re.match(r"\\([a-zA-Z]+)", s[i:])
            if not m:
                return None
            cmd, i = m.group(1), i + m.end()
            if cmd == "frac":
                a, i = _group(s, i)
                b, i = _group(s, i)
                ea = latex_to_expression(a) if a is not None else None
                eb = latex_to_expression(b) if b is not None else None
                if ea is None or eb is None:
                    return None
                out.append(f"(({ea})/({eb}))")
            elif cmd == "sqrt":
                n = None
                if s[i:i + 1] == "[":
                    j = s.find("]", i)
                    if j < 0:
                        return None
                    n, i = latex_to_expression(s[i + 1:j]), j + 1
                    if n is None:
                        return None
                a, i = _group(s, i)
                ea = latex_to_expression(a) if a is not None else None
                if ea is None:
                    return None
                out.append(f"sqrt({ea})" if n is None else f"(({ea})**(1/({n})))")
            elif cmd in ("pi", "cdot", "times", "div"):
                out.append({"pi": " pi ", "cdot": "*", "times": "*", "div": "/"}[cmd])
            else:
                return None
            continue
        if c == "{":
            a, i = _group(s, i)
            ea = latex_to_expression(a) if a is not None else None
            if ea is None:
                return None
            out.append(f"({ea})")
            continue
        if c == "}":
            return None
        out.append("**" if c == "^" else c)
        i += 1
    return _implied_products("".join(out))


def _implied_products(expr: str) -> str:
    tokens = re.findall(r"\d+\.?\d*|\.\d+|[A-Za-z_]+|\*\*|\S", expr)
    out: list[str] = []
    for tok in tokens:
        if out:
            prev = out[-1]
            ends_value = prev[0].isdigit() or prev[0] == "." or prev == ")" \
                or (prev[0].isalpha() and prev not in _FUNCS)
            starts_value = tok[0].isdigit() or tok[0] == "." or tok == "(" or tok[0].isalpha()
            if ends_value and starts_value:
                out.append("*")
        out.append(tok)
    return " ".join(out)


def answer_value(text: str) -> float | None:
    """`text` (an answer, possibly LaTeX: "2\\sqrt{3}", "60^\\circ", "x = \\frac{7}{2}")
    as a number, or None when it is not plain arithmetic."""
    expr = latex_to_expression(_clean(text))
    if not expr:
        return None
    try:
        return calculate(expr)
    except ValueError:
        return None


def grade(reply: str, gold: str) -> tuple[bool, str | None]:
    """(correct?, the boxed answer read or None) for a model's `reply` against `gold`.

    The answer is the last \\boxed{} of the reply. When both it and `gold` are numbers
    (`answer_value`) they must agree within REL_TOL relative; otherwise the two texts
    must be equal once spaces, `$`, degree signs, \\text{} units and "x =" are dropped
    and letters lower-cased. No reply without \\boxed{} is correct.
    """
    got = boxed_answer(reply)
    if got is None:
        return False, None
    a, b = answer_value(got), answer_value(gold)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-9), got
    return _clean(got).lower() == _clean(gold).lower() != "", got


# ---- tool calls ------------------------------------------------------------------

_FENCE = re.compile(r"```(?:python3?|py|calc|calculator)[ \t]*\n(.*?)```", re.DOTALL)
_PRINT = re.compile(r"^print\((.*)\)$")


def parse_action(action: str) -> tuple[list[str], str | None, list[str]]:
    """A turn as (calculator expressions, the final answer's text or None, errors).

    Expressions: each `calculator` tool call (`<tool_call>{"name": "calculator",
    "arguments": {"expression": ...}}</tool_call>`, arguments also as a JSON string),
    then each line of a ```calc or ```python block (`print(...)`, `import` lines and
    comments allowed). The final answer: the text outside tool calls and blocks, when
    it has a \\boxed{}. Errors: why a tool call could not be read, one per call.
    """
    exprs, errors, prose = tool_calls(action, TOOL_NAME, "expression",
                                      'the calculator needs {"arguments": {"expression": "<arithmetic>"}}')
    for block in _FENCE.findall(prose):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if not line or line.startswith(("import ", "from ")):
                continue
            m = _PRINT.match(line)
            exprs.append(m.group(1) if m else line)
    prose = _FENCE.sub("", prose)
    final = prose if boxed_answer(prose) is not None else None
    return exprs, final, errors


def run_calculator(expressions: list[str]) -> str:
    """The observation for a turn's calculator calls: one "expr = value" (or
    "expr: error: why") line each, at most MAX_CALLS_PER_TURN evaluated."""
    lines = []
    for expr in expressions[:MAX_CALLS_PER_TURN]:
        try:
            lines.append(f"{expr} = {format_number(calculate(expr))}")
        except ValueError as e:
            lines.append(f"{expr}: error: {e}")
    if len(expressions) > MAX_CALLS_PER_TURN:
        lines.append(f"[only the first {MAX_CALLS_PER_TURN} calculations of a turn are done]")
    return "\n".join(lines)


# ---- the envs --------------------------------------------------------------------

class Geometry3kGame(AbstractGame):
    """One geometry problem and its diagram; one reply, reward 1.0 iff its \\boxed{}
    answer is right (`grade`), else 0.0. info: {"correct", "answer", "parsed"}.

    env_args:
      data_dir: the data folder (module docstring; default $GEOMETRY3K_DATA, else the
                shipped sample)
      split:    if set (train, validation or test), every episode uses this split,
                whatever the request's split

    Raises ValueError naming the env_arg for a bad value.
    """

    name = "geometry3k"

    def __init__(self, data_dir: str | None = None, split: str | None = None):
        super().__init__(data_dir=data_dir, split=split)
        if split is not None and split not in SPLITS:
            raise ValueError(f"env_args.split: {split!r} is not one of {SPLITS}")
        if data_dir is not None and not isinstance(data_dir, str):
            raise ValueError(f"env_args.data_dir: must be a folder path, got {data_dir!r}")
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self.split = split
        self.problem = Problem("", "", ())

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """{"index", "split"}: a problem of `split` chosen by the group's `seed`."""
        split = self.split or split
        rows = load_split(self.data_dir, split)
        return {"index": self.rng(f"geometry3k:{split}:{seed}").randrange(len(rows)), "split": split}

    def reset(self, index: int = 0, split: str = "train") -> str:
        split = self.split or split
        rows = load_split(self.data_dir, split)
        if not 0 <= index < len(rows):
            raise ValueError(f"index: {index} is outside 0..{len(rows) - 1} of split {split!r}")
        self.problem = rows[index]
        return ""

    def get_system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def get_initial_user_message(self) -> str:
        """The problem text without its `<image>` marker (the diagram comes as an image)."""
        return self.problem.problem.replace(IMAGE_MARKER, " ").strip()

    def get_initial_images(self) -> list[Any]:
        return list(self.problem.images)

    def step(self, action: str) -> StepResult:
        correct, got = grade(action, self.problem.answer)
        return StepResult("", 1.0 if correct else 0.0, True,
                          {"correct": correct, "answer": self.problem.answer, "parsed": got})


class Geometry3kToolGame(Geometry3kGame):
    """`geometry3k` over several turns with a `calculator` tool (`get_tools`).

    A turn with a \\boxed{} answer (outside tool calls) ends the episode, reward as in
    `geometry3k`; a turn with calculator calls gets their results as the observation
    (reward 0, not done); a turn with neither gets a reminder of the format. The
    number of turns is the job's `sampling.max_turns`. env_args as `geometry3k`.
    """

    name = "geometry3k-tool"
    tool_calls = 0  # calculations done this episode

    def reset(self, index: int = 0, split: str = "train") -> str:
        self.tool_calls = 0
        return super().reset(index=index, split=split)

    def get_system_prompt(self) -> str:
        return ("You are given a geometry problem and its diagram. Reason step by step. You may "
                "use the `calculator` tool for arithmetic (or write one expression per line in a "
                "```calc block); its results come in the next message. Trigonometric functions "
                "take radians: sin(radians(30)). When you know the answer, put it in \\boxed{}, "
                "e.g. \\boxed{2\\sqrt{3}} or \\boxed{14.5}.")

    def get_tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def step(self, action: str) -> StepResult:
        exprs, final, errors = parse_action(action)
        if final is not None:
            result = super().step(final)
            result.info["tool_calls"] = self.tool_calls
            return result
        info = {"correct": False, "answer": self.problem.answer, "parsed": None}
        if exprs:
            self.tool_calls += len(exprs)
            obs = "\n".join([*(f"Tool call error: {e}" for e in errors), run_calculator(exprs)])
            return StepResult(obs, 0.0, False, {**info, "tool_calls": self.tool_calls})
        why = "".join(f"Your tool call could not be run: {e}. " for e in errors)
        return StepResult(why + "Call the `calculator` tool (or write expressions in a ```calc "
                          "block) to compute, or give the final answer in \\boxed{}.", 0.0, False,
                          {**info, "tool_calls": self.tool_calls})
