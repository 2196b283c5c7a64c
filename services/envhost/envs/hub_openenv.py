"""Serve an OpenEnv environment (Meta-PyTorch's OpenEnv, PyPI `openenv-core`) as an
AbstractGame, so an env written for OpenEnv trains with OpenTinker jobs unchanged.

The operator picks the env on the envhost command line:

    opentinker envhost --env 'openenv:my_module:MyEnvironment?size=5'  # in process
    opentinker envhost --env 'openenv+http://127.0.0.1:8000?action_field=message' --name my-env

In process, each episode gets its own instance (`MyEnvironment(**kwargs)`, the query's
kwargs), as OpenEnv's server gives each session its own; against a running server, each
episode opens its own session (OpenEnv's `GenericEnvClient`, one WebSocket per episode).
A job's `env_args` must be empty: what is served, and with which arguments, is the
operator's choice.

The protocol (OpenEnv's Gym-style API, https://github.com/meta-pytorch/OpenEnv,
`openenv/core/env_server/interfaces.py`):

- `reset(seed=...)`: the group's seed (the test split's seeds are offset by 2**30, as
  OpenEnv has no splits); the first observation is the first user message;
- `step(action)`: the model's text becomes the env's Action: by default the Action class
  (the first type argument of `Environment[Action, Observation, State]`) built from its
  single string field, or over a server `{action_field: text}` (default "message"); an
  operator's `?action=module:function` (text -> Action, or dict for a server) replaces
  that; the Observation's `reward` (None counts 0) and `done` are the turn's;
- an observation is shown as its one string field when it has exactly one, else as JSON
  of its fields (OpenEnv's wire form, without reward, done and metadata);
- `info`: the observation's metadata and the env's `state` after the step.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Any, Callable

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.envhost.loader import EnvLoadError, import_target, refuse_env_args, split_query

PIP = "openenv-core"  # the PyPI package (the `envs` extra installs it)
TEST_SEED_OFFSET = 2 ** 30


def _openenv(spec: str):
    try:
        from openenv.core.env_server import interfaces, types
    except ImportError as e:
        raise EnvLoadError(f"--env {spec!r}: OpenEnv is not installed (pip install {PIP}): {e}") from None
    return interfaces, types


def render(fields: dict[str, Any]) -> str:
    """An observation's fields (without reward, done, metadata) as the model sees them."""
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return json.dumps(fields, ensure_ascii=False, default=str)


def _dump(x: Any) -> Any:
    return x.model_dump() if hasattr(x, "model_dump") else x


class OpenEnvGame(AbstractGame):
    """One episode of the bound OpenEnv env (see the module docstring).

    Class attributes, set by `openenv_game`: `hub_cls` and `hub_kwargs` (in process) or
    `hub_url` (a server), `to_action` (text -> Action), `hub_spec`.
    """

    hub_cls: Any = None
    hub_kwargs: dict[str, Any] = {}
    hub_url: str = ""
    to_action: Callable[[str], Any] | None = None
    hub_spec: str = ""

    def __init__(self, **env_args: Any):
        refuse_env_args("an OpenEnv", self.name, self.hub_spec, env_args)
        super().__init__()
        self.env: Any = None  # the Environment instance, or a SyncEnvClient session
        self.turn = 0

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        return {"seed": int(seed) % TEST_SEED_OFFSET + (TEST_SEED_OFFSET if split == "test" else 0)}

    def reset(self, seed: int = 0, **_: Any) -> str:
        self.turn = 0
        if self.hub_cls is not None:
            self.env = self.hub_cls(**self.hub_kwargs)
            obs = self.env.reset(seed=seed)
            return render(obs.model_dump(exclude={"reward", "done", "metadata"}))
        from openenv.core.generic_client import GenericEnvClient

        self.env = GenericEnvClient(base_url=self.hub_url).sync()
        self.env.connect()
        return render(dict(self.env.reset(seed=seed).observation or {}))

    def step(self, action: str) -> StepResult:
        self.turn += 1
        act = self.to_action(action)
        if self.hub_cls is not None:
            obs = self.env.step(act)
            fields = obs.model_dump(exclude={"reward", "done", "metadata"})
            reward, done, meta = obs.reward, obs.done, dict(obs.metadata or {})
            state = _dump(self.env.state)
        else:
            r = self.env.step(act)
            fields = {k: v for k, v in dict(r.observation or {}).items() if k != "metadata"}
            reward, done, meta = r.reward, r.done, dict((r.observation or {}).get("metadata") or {})
            state = _dump(self.env.state())
        info = {"turn": self.turn, "metadata": meta, "state": state}
        if done:
            self.close()
        return StepResult(render(fields), float(reward or 0.0), bool(done), info)

    def close(self) -> None:
        """Let go of the episode's env: closes a server session."""
        env, self.env = self.env, None
        if env is not None and callable(getattr(env, "close", None)):
            env.close()


def action_class(cls: type, interfaces: Any, types: Any) -> type | None:
    """The Action type an Environment subclass declares (`Environment[Act, Obs, State]`)."""
    for base in cls.__mro__:
        for orig in getattr(base, "__orig_bases__", ()):
            origin = typing.get_origin(orig)
            if isinstance(origin, type) and issubclass(origin, interfaces.Environment):
                args = typing.get_args(orig)
                if args and isinstance(args[0], type) and issubclass(args[0], types.Action):
                    return args[0]
    return None


def text_action(act_cls: type, spec: str) -> Callable[[str], Any]:
    """text -> `act_cls(field=text)` for its single string field (besides metadata).

    Raises EnvLoadError naming the spec when there is no such single field.
    """
    fields = {n: f for n, f in act_cls.model_fields.items() if n != "metadata"}
    required = [n for n, f in fields.items() if f.is_required()]
    strings = [n for n, f in fields.items() if f.annotation is str]
    pick = required if len(required) == 1 and required[0] in strings else strings
    if len(pick) != 1:
        raise EnvLoadError(f"--env {spec!r}: cannot build {act_cls.__name__} from text (fields "
                           f"{sorted(fields)}); pass ?action=module:function, a function text -> "
                           f"{act_cls.__name__}")
    field = pick[0]
    return lambda text: act_cls(**{field: text})


def _served_name(raw: str) -> str:
    return re.sub(r"[^a-z0-9_-]+", "-", raw.lower()).strip("-_") or "openenv"


def openenv_game(spec: str, env_path: list[str] | None = None) -> type[OpenEnvGame]:
    """An OpenEnvGame subclass bound to `spec`: "openenv:module:Class[?k=v&...]" (kwargs for
    the class; `action=module:function` picks the text -> Action function) or
    "openenv+http(s)://host:port[?action_field=NAME|action=module:function]".

    Raises EnvLoadError naming the spec: OpenEnv not installed, the class not found or not
    an OpenEnv Environment, no way to build an Action from text.
    """
    interfaces, types = _openenv(spec)
    remote = spec.startswith(("openenv+http://", "openenv+https://"))
    target, kwargs = split_query(spec, spec[len("openenv+"):] if remote else spec[len("openenv:"):])
    action_fn = kwargs.pop("action", None)
    to_action: Callable[[str], Any] | None = None
    if action_fn is not None:
        mod, _, fn = str(action_fn).rpartition(":")
        to_action = getattr(import_target(mod, spec, env_path), fn, None) if mod else None
        if not callable(to_action):
            raise EnvLoadError(f"--env {spec!r}: action={action_fn!r} is not a module:function")
    attrs: dict[str, Any] = {"hub_spec": spec, "__module__": __name__}
    if remote:
        field = str(kwargs.pop("action_field", "message"))
        if kwargs:
            raise EnvLoadError(f"--env {spec!r}: unknown options {sorted(kwargs)} (action, action_field)")
        host = re.sub(r"^https?://", "", target).split("/")[0]
        attrs.update(name=_served_name(f"openenv-{host}"), hub_url=target,
                     to_action=staticmethod(to_action or (lambda text: {field: text})))
        return type("OpenEnvRemote", (OpenEnvGame,), attrs)
    module_name, _, cls_name = target.rpartition(":")
    if not module_name or not cls_name:
        raise EnvLoadError(f"--env {spec!r}: expected openenv:module:Class")
    cls = getattr(import_target(module_name, spec, env_path), cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, interfaces.Environment)):
        raise EnvLoadError(f"--env {spec!r}: {cls_name} is not an OpenEnv Environment subclass "
                           "(openenv.core.env_server.Environment)")
    if to_action is None:
        act_cls = action_class(cls, interfaces, types)
        if act_cls is None:
            raise EnvLoadError(f"--env {spec!r}: {cls_name} declares no Action type "
                               "(Environment[MyAction, ...]); pass ?action=module:function")
        to_action = text_action(act_cls, spec)
    name = re.sub(r"(environment|env)$", "", cls_name.lower()) or cls_name.lower()
    attrs.update(name=_served_name(name), hub_cls=cls, hub_kwargs=kwargs, to_action=staticmethod(to_action))
    return type(f"OpenEnv_{cls_name}", (OpenEnvGame,), attrs)
