"""Upstream OpenTinker's client helpers that its scripts import
(opentinker/client/utils/utils.py): `resolve_paths_in_config`, `resolve_path`,
`find_free_port`, `tolerant_merge_dicts`.

Upstream's DataProto (de)serialization and dataset preparation are not here: this
service takes no tokenized batches from a client (the rows stay in the caller's
process, environment/base_game_environment.py). Standard library only (hydra when
it is running).
"""

from __future__ import annotations

import copy
import os
import socket
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: The config keys upstream resolves against the directory the script was started in.
PATH_FIELDS = ("data_path", "val_data_path", "tokenizer_path", "config_path", "checkpoint_path", "output_dir")
_FILE_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".jsonl", ".parquet", ".txt", ".csv", ".bin", ".safetensors")


def launch_dir() -> str:
    """The directory the script was started in (hydra moves the process to its outputs/
    folder by default), else the current one."""
    try:
        from hydra.utils import get_original_cwd

        return get_original_cwd()
    except (ImportError, ValueError):
        return os.getcwd()


def resolve_path(path: str, original_cwd: str | None = None) -> str:
    """`path` as an absolute path, relative ones against `original_cwd` (default: the
    directory the script was started in), as upstream does. Kept as given: an absolute
    path, a Hugging Face id ("namespace/name" without a file suffix), and, unlike
    upstream, a bare name that is no file there (a model name of this service such as
    "smollm2-135m-instruct")."""
    if not path or os.path.isabs(path):
        return path
    parts = path.split("/")
    if len(parts) == 2 and not path.endswith(_FILE_SUFFIXES):
        return path
    base = Path(original_cwd or launch_dir())
    if len(parts) == 1 and not path.endswith(_FILE_SUFFIXES) and not (base / path).exists():
        return path
    return str(base / path)


def resolve_paths_in_config(config: Any, original_cwd: str | None = None) -> Any:
    """Resolve PATH_FIELDS of `config` (an OmegaConf DictConfig, a dict or a namespace)
    in place with `resolve_path`; returns `config`."""
    cwd = original_cwd or launch_dir()
    for key in PATH_FIELDS:
        value = config.get(key) if hasattr(config, "get") else getattr(config, key, None)
        if isinstance(value, str) and value:
            if hasattr(config, "get"):
                config[key] = resolve_path(value, cwd)
            else:
                setattr(config, key, resolve_path(value, cwd))
    return config


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port the OS has free on `host` now (another process may take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tolerant_merge_dicts(*dicts: Mapping[str, Any] | None) -> dict[str, Any]:
    """Merge dicts left to right, recursing into nested mappings; a key whose value
    changes type is overridden by the later one with a RuntimeWarning (upstream's)."""
    result: dict[str, Any] = {}
    for d in dicts:
        for k, v in (d or {}).items():
            old = result.get(k)
            if k in result and isinstance(old, Mapping) and isinstance(v, Mapping):
                result[k] = tolerant_merge_dicts(old, v)
                continue
            if k in result:
                warnings.warn(f"Config key '{k}' overridden. Old type={type(old)}, new type={type(v)}",
                              RuntimeWarning, stacklevel=2)
            result[k] = copy.deepcopy(v)
    return result
