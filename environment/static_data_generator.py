"""Rows of a dataset file as episodes' prompts and reset kwargs, at upstream
OpenTinker's import path (`opentinker.environment.static_data_generator`).

Upstream OpenTinker (github.com/open-tinker/OpenTinker) turns each row of a Parquet or
JSON(L) file into a sample: `prompt` (a list of {"role", "content"} messages, or a string
taken as one user message, the game's system prompt put first unless the row has one)
and `env_kwargs` for the game's `reset(**env_kwargs)`: `ground_truth` (the row's
`ground_truth`, else `reward_model.ground_truth`, else `extra_info.ground_truth`),
`extra_info` (whole) and `data_source` (the row's, else the interaction name). The same
rules here; the file is read on this machine and stays there.

A vision-language row (upstream's Geo3K data) also has `images`: a list of images as
Hugging Face datasets stores them ({"bytes": ..., "path": ...}), file bytes, or paths.
They become the sample's "images" (bytes, or the path when there are none), shown
before the first user message's text (environment/base_game.py), so the `<image>`
placeholders upstream puts in the prompt text are taken out of it.

Parquet needs pyarrow (`pip install pyarrow`), imported only when a .parquet file is read.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SAMPLE_KEYS = ("prompt", "env_kwargs", "data_source")
IMAGE_PLACEHOLDER = "<image>"


def row_images(value: Any) -> list[Any]:
    """A row's `images` as bytes (or paths): [] for none. Raises ValueError naming what
    an entry is when it is no image."""
    out = []
    for i, img in enumerate(value or []):
        if isinstance(img, dict):
            img = img.get("bytes") or img.get("path")
        if not isinstance(img, (bytes, bytearray, str, Path)) or not img:
            raise ValueError(f"images[{i}]: {type(img).__name__} is no image (bytes, a path, or {{'bytes': ...}})")
        out.append(bytes(img) if isinstance(img, bytearray) else img)
    return out


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a .parquet, .jsonl or .json file (a JSON list, one object, or JSON
    lines) as a dict. Raises FileNotFoundError, ValueError for another extension or a
    row that is not an object, ImportError naming pyarrow for Parquet without it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {p.name} needs pyarrow: pip install pyarrow") from None
        rows = pq.read_table(p).to_pylist()
    elif suffix in (".jsonl", ".json"):
        text = p.read_text()
        try:
            got = json.loads(text)
            rows = got if isinstance(got, list) else [got]
        except json.JSONDecodeError:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        raise ValueError(f"data file {p.name}: expected .parquet, .jsonl or .json")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"data file {p.name}: row {i} is a {type(row).__name__}, not an object")
    return rows


def sample_from_row(row: dict[str, Any], interaction_name: str, system_prompt: str | None = None,
                    prompt_key: str = "prompt", ground_truth_key: str | None = "ground_truth",
                    data_source_key: str | None = "data_source",
                    extra_keys: tuple[str, ...] | list[str] = (), image_key: str = "images") -> dict[str, Any]:
    """One row as upstream's sample: {"prompt": [messages], "env_kwargs": {...},
    "data_source": str}, and "images" when the row has some (rules in the module
    docstring). Raises ValueError for an `images` entry that is no image."""
    prompt = row.get(prompt_key) or []
    if not isinstance(prompt, list):
        prompt = [{"role": "user", "content": str(prompt)}]
    images = row_images(row.get(image_key)) if image_key else []
    prompt = [{"role": str(m.get("role", "user")), "content": str(m.get("content") or "")} for m in prompt]
    if images:
        prompt = [{**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, "").strip()} for m in prompt]
    if system_prompt and (not prompt or prompt[0]["role"] != "system"):
        prompt = [{"role": "system", "content": system_prompt}] + prompt
    env_kwargs: dict[str, Any] = {}
    if ground_truth_key:
        for holder in (row, row.get("reward_model"), row.get("extra_info")):
            if isinstance(holder, dict) and ground_truth_key in holder:
                env_kwargs["ground_truth"] = holder[ground_truth_key]
                break
    for key in extra_keys:
        if key in row:
            env_kwargs[key] = row[key]
    if "extra_info" in row:
        env_kwargs["extra_info"] = row["extra_info"]
    data_source = row.get(data_source_key) if data_source_key and row.get(data_source_key) else interaction_name
    env_kwargs["data_source"] = data_source
    sample = {"prompt": prompt, "env_kwargs": env_kwargs, "data_source": data_source}
    if images:
        sample["images"] = images
    return sample


class StaticDatasetGenerator:
    """Samples from dataset files (upstream's class and arguments; `cache_dir` is
    accepted and unused). `generate_sample(i)` is sample i of the (seeded, when
    `shuffle`) order, wrapping around."""

    def __init__(self, data_paths: str | list[str], interaction_name: str = "math", prompt_key: str = "prompt",
                 ground_truth_key: str | None = "ground_truth", data_source_key: str | None = "data_source",
                 extra_keys: list[str] | None = None, shuffle: bool = True, seed: int | None = None,
                 cache_dir: str | None = None, system_prompt: str | None = None):
        paths = [data_paths] if isinstance(data_paths, (str, Path)) else list(data_paths)
        self._samples = [row for p in paths for row in read_rows(p)]
        if not self._samples:
            raise ValueError(f"data files {paths}: no rows")
        self._interaction_name = interaction_name
        self.prompt_key, self.ground_truth_key, self.data_source_key = prompt_key, ground_truth_key, data_source_key
        self.extra_keys = list(extra_keys or [])
        self.system_prompt = system_prompt
        self._indices = list(range(len(self._samples)))
        if shuffle:
            random.Random(seed).shuffle(self._indices)

    def __len__(self) -> int:
        return len(self._samples)

    def get_interaction_name(self) -> str:
        return self._interaction_name

    def generate_sample(self, index: int) -> dict[str, Any]:
        """Sample `index` (modulo the number of rows)."""
        row = self._samples[self._indices[index % len(self._samples)]]
        return sample_from_row(row, self._interaction_name, self.system_prompt, self.prompt_key,
                               self.ground_truth_key, self.data_source_key, self.extra_keys)
