"""Find the environment classes an envhost serves, from `--env` specs.

A spec is one of:
- a built-in name: `arith`
- `module:Class`: the module imported from the working directory or an `--env-path`
- `path/to/file.py:Class`: a file anywhere, imported under a private module name
- an environment hub's env, adapted to AbstractGame (the library is imported only then):
  - `verifiers:ENV_ID[?key=value&...]`: `verifiers.load_environment(ENV_ID, key=value, ...)`,
    or `verifiers:module:function[?...]`: the operator's function that returns one
    (envs/hub_verifiers.py)
  - `openenv:module:Class[?key=value&...]`: an OpenEnv `Environment` run in process, one
    instance per episode, or `openenv+http://host:port[?...]`: a running OpenEnv server
    (envs/hub_openenv.py)

The operator picks these on the command line; a job spec only names the served env. Query
values are JSON when they parse as JSON, else strings.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from opentinker.schemas.job import ENV_NAME_RE
from opentinker.environment.base_game import AbstractGame
from opentinker.services.envhost.registry import BUILTIN


class EnvLoadError(ValueError):
    """An `--env` spec could not be turned into a served environment."""


def load_class(spec: str, env_path: list[str] | None = None) -> type[AbstractGame]:
    """The AbstractGame subclass a spec names; a hub spec (`verifiers:`, `openenv:`,
    `openenv+http(s)://`) gets its adapter's subclass, bound to the hub env.

    Raises EnvLoadError naming the spec: unknown built-in, module or file not found,
    no such attribute, or not an AbstractGame subclass (hub specs: the adapter's own
    checks, e.g. the library not installed). Errors raised while importing the user's
    module propagate with their own traceback.
    """
    if spec.startswith(HUB_PREFIXES):
        return _load_hub(spec, env_path)
    if ":" not in spec:
        if spec in BUILTIN:
            return BUILTIN[spec]
        raise EnvLoadError(f"--env {spec!r}: not a built-in ({', '.join(BUILTIN)}); "
                           "use module:Class or path/to/file.py:Class")
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise EnvLoadError(f"--env {spec!r}: expected module:Class")
    module = import_target(target, spec, env_path)
    cls = getattr(module, attr, None)
    if cls is None:
        raise EnvLoadError(f"--env {spec!r}: {module.__name__} has no attribute {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, AbstractGame)):
        raise EnvLoadError(f"--env {spec!r}: {attr} is not a subclass of "
                           "opentinker.environment.base_game.AbstractGame")
    return cls


def import_target(target: str, spec: str, env_path: list[str] | None = None):
    """The module `target` names: a file (`path/to/file.py`) or a module name imported
    from the working directory or an `--env-path` folder.

    Raises EnvLoadError naming `spec` if the file or module is not found; errors raised
    while importing it propagate.
    """
    if target.endswith(".py") or os.sep in target or "/" in target:
        return _import_file(Path(target), spec)
    add_env_path(env_path)
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and target.startswith(e.name):  # the named module itself, not a dependency
            raise EnvLoadError(f"--env {spec!r}: module {target!r} not found "
                               f"(searched the working directory and --env-path)") from None
        raise


def add_env_path(env_path: list[str] | None = None) -> None:
    """Put the working directory and the `--env-path` folders first on sys.path."""
    for p in reversed([os.getcwd(), *(env_path or [])]):
        if p not in sys.path:
            sys.path.insert(0, p)


#: spec prefixes that name an environment hub's env rather than an AbstractGame class
HUB_PREFIXES = ("verifiers:", "openenv:", "openenv+http://", "openenv+https://")


def split_query(spec: str, body: str) -> tuple[str, dict[str, Any]]:
    """`body` ("target?key=value&...") as (target, {key: value}); a value is JSON when it
    parses as JSON, else the string. Raises EnvLoadError naming `spec` for a repeated key."""
    target, _, query = body.partition("?")
    kwargs: dict[str, Any] = {}
    for key, raw in parse_qsl(query, keep_blank_values=True):
        if key in kwargs:
            raise EnvLoadError(f"--env {spec!r}: {key!r} is given twice")
        try:
            kwargs[key] = json.loads(raw)
        except ValueError:
            kwargs[key] = raw
    return target, kwargs


def refuse_env_args(kind: str, name: str, spec: str, env_args: dict[str, Any]) -> None:
    """A hub env's arguments are the operator's (its `--env` spec), never a job's.
    Raises ValueError naming env_args when a job passed any."""
    if env_args:
        raise ValueError(f"env_args: {name!r} is {kind} env ({spec}); it takes no env_args "
                         f"(got {sorted(env_args)}): its arguments are set by the operator on the "
                         "envhost command line")


def _load_hub(spec: str, env_path: list[str] | None) -> type[AbstractGame]:
    # Imported here: the hub libraries are optional, and only an operator who serves one
    # needs them.
    if spec.startswith("verifiers:"):
        from opentinker.services.envhost.envs.hub_verifiers import verifiers_game

        return verifiers_game(spec, env_path)
    from opentinker.services.envhost.envs.hub_openenv import openenv_game

    return openenv_game(spec, env_path)


def env_name(cls: type[AbstractGame], override: str | None = None) -> str:
    """The name an env is served under: `override` (`--name`), else the class's
    `get_interaction_name()` (the `name` attribute when set, else OpenTinker's default:
    the class name lower-cased without "game"). The method is asked on an instance
    made without `__init__` (names are constants or class-derived), else on `cls()`.

    Raises EnvLoadError if neither instance answers, or the name is empty or not
    [a-z0-9][a-z0-9_-]*.
    """
    name = override
    if not name:
        errors = []
        for make in (lambda: cls.__new__(cls), cls):
            try:
                name = make().get_interaction_name()
                break
            except Exception as e:  # user code: try the next way, then name it
                errors.append(f"{type(e).__name__}: {e}")
        else:
            raise EnvLoadError(f"{cls.__qualname__}: get_interaction_name() failed ({'; '.join(errors)}); "
                               "pass --name")
    if not isinstance(name, str) or not name:
        raise EnvLoadError(f"{cls.__qualname__}: no env name (get_interaction_name() gave {name!r}); "
                           "set a class attribute `name = \"my-env\"` or pass --name")
    if not ENV_NAME_RE.match(name):
        raise EnvLoadError(f"{cls.__qualname__}: env name {name!r} must match {ENV_NAME_RE.pattern}")
    return name


def load_envs(specs: list[str], env_path: list[str] | None = None,
              name: str | None = None) -> dict[str, type[AbstractGame]]:
    """{name: class} for `specs`, or every built-in when `specs` is empty.

    Raises EnvLoadError for a bad spec, `--name` with more than one env, or two envs
    with one name.
    """
    if not specs:
        return dict(BUILTIN)
    if name and len(specs) > 1:
        raise EnvLoadError("--name applies to a single --env")
    envs: dict[str, type[AbstractGame]] = {}
    for spec in specs:
        cls = load_class(spec, env_path)
        n = env_name(cls, name)
        if n in envs:
            raise EnvLoadError(f"two --env specs are named {n!r}")
        envs[n] = cls
    return envs


def _import_file(path: Path, spec: str):
    path = path.expanduser().resolve()
    if not path.is_file():
        raise EnvLoadError(f"--env {spec!r}: file {path} not found")
    # The file's folder goes on sys.path so it can import its sibling modules.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    # One module per file: two --env specs naming classes of one file share it, and
    # two files with one stem in different folders do not clash.
    mod_name = f"opentinker_user_env_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    mspec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up here
    mspec.loader.exec_module(module)
    return module
