"""`gsm8k`: data-dependent, single-turn grade-school math (GSM8K, arXiv 2110.14168).

`prepare_gsm8k` turns GSM8K's JSONL ({"question", "answer"} with the final answer
after "####") into Parquet once (`opentinker data gsm8k`); the env reads that
Parquet on the envhost side, once per process.

Held out: GSM8K's own files, 7,473 train and 1,319 test problems, no question in both
(tests/unit/test_heldout_splits.py checks both); split "test" reads only test.parquet.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.core.config import default_home
from opentinker.services.envhost.envs.answers import verify_answer

SPLITS = ("train", "test")
_MARK = "####"


def default_data_dir() -> Path:
    """Where `opentinker data gsm8k` writes: <OPENTINKER_HOME>/data/gsm8k."""
    return Path(default_home()) / "data" / "gsm8k"


def final_of(answer: str) -> str:
    """The number after GSM8K's "####" mark, commas and "$" stripped ("1,200" -> "1200").

    Raises ValueError when the answer has no "####" mark or no number after it.
    """
    if _MARK not in answer:
        raise ValueError("answer: no '####' final-answer mark")
    final = answer.rsplit(_MARK, 1)[1].strip().replace(",", "").replace("$", "")
    float(final)  # raises ValueError for a non-numeric final answer
    return final


def prepare_gsm8k(src_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, int]:
    """Convert `<src_dir>/{train,test}.jsonl` to `<out_dir>/{train,test}.parquet`.

    Columns: question (str), answer (str, the worked solution), final (str, the
    number after "####"). Splits whose JSONL is missing are skipped. Files are written
    to a temporary name and renamed, so a reader never sees half a file.
    Returns {split: rows written}. Raises FileNotFoundError when no split is found and
    ValueError naming the file and line of a malformed record.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    src, out = Path(src_dir), Path(out_dir) if out_dir else default_data_dir()
    counts: dict[str, int] = {}
    for split in SPLITS:
        path = src / f"{split}.jsonl"
        if not path.exists():
            continue
        rows: dict[str, list[str]] = {"question": [], "answer": [], "final": []}
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    q, a = rec["question"], rec["answer"]
                    rows["final"].append(final_of(a))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{lineno}: bad GSM8K record: {e!r}") from None
                rows["question"].append(q)
                rows["answer"].append(a)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{split}.parquet.tmp"
        pq.write_table(pa.table(rows), tmp)
        os.replace(tmp, out / f"{split}.parquet")
        counts[split] = len(rows["question"])
    if not counts:
        raise FileNotFoundError(f"no {'/'.join(SPLITS)}.jsonl in {src}")
    return counts


_cache: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
_cache_lock = threading.Lock()


def load_split(data_dir: str | Path, split: str) -> tuple[list[str], list[str]]:
    """(questions, finals) of one split, read once per process (envhost threads share it).

    Raises FileNotFoundError saying how to make the data.
    """
    key = (str(Path(data_dir).resolve()), split)
    with _cache_lock:
        if key not in _cache:
            import pyarrow.parquet as pq

            path = Path(key[0]) / f"{split}.parquet"
            if not path.exists():
                raise FileNotFoundError(
                    f"{path} not found: run `opentinker data gsm8k` (or prepare_gsm8k) first")
            t = pq.read_table(path, columns=["question", "final"])
            _cache[key] = (t.column("question").to_pylist(), t.column("final").to_pylist())
        return _cache[key]


class GSM8KGame(AbstractGame):
    """One GSM8K problem; reward 1.0 iff the reply's final answer equals the gold one.

    The answer is read and compared by `answers.verify_answer` (Math-Verify): the
    line after a "####" mark if the reply has one, else a \\boxed{} answer or the last
    number or expression; "1,200", "$18." and "\\frac{1}{2}" read as numbers.

    env_args:
      data_dir: the Parquet folder (default <OPENTINKER_HOME>/data/gsm8k)
      split:    if set, every episode uses this split, whatever the request's split
    """

    name = "gsm8k"

    def __init__(self, data_dir: str | None = None, split: str | None = None):
        super().__init__(data_dir=data_dir, split=split)
        if split is not None and split not in SPLITS:
            raise ValueError(f"env_args.split: {split!r} is not one of {SPLITS}")
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self.split = split
        self.question, self.final = "", ""

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        """{"index", "split"}: a row of `split` chosen by `seed`."""
        split = self.split or split
        if split not in SPLITS:
            raise ValueError(f"split: {split!r} is not one of {SPLITS}")
        questions, _ = load_split(self.data_dir, split)
        return {"index": self.rng(f"gsm8k:{split}:{seed}").randrange(len(questions)), "split": split}

    def reset(self, index: int = 0, split: str = "train") -> str:
        split = self.split or split
        questions, finals = load_split(self.data_dir, split)
        if not 0 <= index < len(questions):
            raise ValueError(f"index: {index} is outside 0..{len(questions) - 1} of split {split!r}")
        self.question, self.final = questions[index], finals[index]
        return ""

    def get_system_prompt(self) -> str:
        return ("Solve the math word problem. Reason briefly, step by step, then write the "
                "final answer on its own last line as '#### <number>'.")

    def get_initial_user_message(self) -> str:
        return self.question

    def step(self, action: str) -> StepResult:
        correct, got = verify_answer(action, self.final)
        return StepResult(observation="", reward=1.0 if correct else 0.0, done=True,
                          info={"answer": self.final, "parsed": got, "correct": correct})
