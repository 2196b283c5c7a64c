"""Serve a `verifiers` environment (Prime Intellect's environment hub format) as an
AbstractGame, so an env written for verifiers trains with OpenTinker jobs unchanged.

The operator picks the env on the envhost command line:

    opentinker envhost --env 'verifiers:my-env?num_examples=100'   # load_environment("my-env", ...)
    opentinker envhost --env 'verifiers:my_module:make_env'        # my_module.make_env(...)

The env is loaded once, when the envhost starts (verifiers' `Environment` installs signal
handlers, which Python allows only on the main thread), and every episode of every job
shares it, each with its own rollout `State`, as verifiers' own `generate` does. A job's
`env_args` must therefore be empty: the load arguments are the operator's.

How an episode follows verifiers' `MultiTurnEnv.rollout` (verifiers 0.1.x,
`verifiers/envs/multiturn_env.py`, https://github.com/PrimeIntellect-ai/verifiers):

- the group's seed picks a dataset row: the train split draws from `env.dataset`, the
  test split from `env.eval_dataset`, or, without one, from a seeded tenth of the
  dataset held out of the train split (an env with only an `eval_dataset` is split the
  same way, so training never sees a test row; a one-row dataset cannot be split and
  both splits ask its row);
- `init_state(row)` and `setup_state`; the row's prompt becomes the system prompt (its
  system messages) and the first user message (the rest; earlier turns of a few-shot
  prompt are rendered as text before the last message);
- each model turn is appended to the trajectory (`add_trajectory_step`); the env's stop
  conditions (`is_completed`: `max_turns`, a ToolEnv turn without tool calls, the env's
  own `@vf.stop` methods) end the episode, else the env answers (`env_response`, through
  `get_prompt_messages`) and that answer is the next observation; a `final_env_response`
  ends the episode with it as the last observation;
- a ToolEnv's tools are offered through `get_tools()` (its OpenAI schemas); the model's
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the format chat
  templates such as Qwen's and Hermes' render), or a reply that is one bare JSON call
  (Llama 3.1's), become the message's `tool_calls`, which the env parses and runs itself;
- at the end, `render_completion` and the env's rubric score the rollout
  (`rubric.score_rollout`): the weighted sum of its reward functions is the reward of the
  final turn (0 on the others), and each function's value is in `info["metrics"]`.

Episodes cut short by the job's `sampling.max_turns` before the env stops are not scored.
Not supported (refused at load): completion-type envs (`message_type="completion"`) and
rubrics with group-level reward functions (they need the whole group's rollouts).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.envhost.loader import EnvLoadError, import_target, refuse_env_args, split_query

PIP = "verifiers==0.1.10"  # the PyPI package, tested version (the `envs` extra installs it)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MODEL = "opentinker"  # what the env's state records as the model name


def _vf(spec: str = "verifiers:..."):
    try:
        import verifiers
    except ImportError as e:
        raise EnvLoadError(f"--env {spec!r}: the verifiers library is not installed "
                           f"(pip install '{PIP}'): {e}") from None
    if not hasattr(verifiers, "MultiTurnEnv"):  # 0.4 replaced the Environment API (verifiers.v1)
        raise EnvLoadError(f"--env {spec!r}: verifiers {getattr(verifiers, '__version__', '?')} has no "
                           f"Environment/MultiTurnEnv API (pip install '{PIP}')")
    return verifiers


class _Loop:
    """An asyncio loop in a daemon thread that runs one hub env's coroutines, so all its
    episodes share one loop as verifiers' own rollouts do."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=f"vf-{name}", daemon=True).start()

    def run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict)
                         and p.get("type") == "text")
    return str(content)


def _bare_call(action: str) -> dict[str, Any] | None:
    """A reply that is only `{"name": ..., "arguments"|"parameters": {...}}` (Llama 3.1's
    JSON tool-call format), else None."""
    try:
        call = json.loads(action)
    except ValueError:
        return None
    if isinstance(call, dict) and isinstance(call.get("name"), str) and ("arguments" in call or "parameters" in call):
        args = call.get("arguments", call.get("parameters"))
        return {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}
    return None


def assistant_message(action: str, with_tools: bool) -> dict[str, Any]:
    """The model's turn as an OpenAI chat message. With tools, each `<tool_call>` block
    (Qwen's and Hermes' format), or a reply that is one bare JSON call (Llama 3.1's),
    becomes a `tool_calls` entry (`arguments` as a JSON string, as OpenAI sends it); a
    block that is not JSON is passed on as it is, for the env's own error handling."""
    if not with_tools:
        return {"role": "assistant", "content": action}
    if not _TOOL_CALL.search(action):
        bare = _bare_call(action.strip())
        if bare is None:
            return {"role": "assistant", "content": action}
        return {"role": "assistant", "content": "",
                "tool_calls": [{"id": "call_0", "type": "function", "function": bare}]}
    calls = []
    for i, body in enumerate(_TOOL_CALL.findall(action)):
        try:
            call = json.loads(body)
            name, args = str(call.get("name", "")), call.get("arguments", {})
            args = args if isinstance(args, str) else json.dumps(args)
        except (ValueError, AttributeError):
            name, args = "", body
        calls.append({"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}})
    content = _TOOL_CALL.sub("", action).strip()
    return {"role": "assistant", "content": content, "tool_calls": calls}


def _all_funcs(rubric) -> list[tuple[Any, Any]]:
    """(rubric, reward function) for every function of a rubric or rubric group."""
    subs = getattr(rubric, "rubrics", None)
    if subs is not None:
        return [pair for sub in subs for pair in _all_funcs(sub)]
    return [(rubric, f) for f in rubric.funcs]


class VerifiersGame(AbstractGame):
    """One episode of the bound verifiers env (see the module docstring).

    Class attributes, set by `verifiers_game`: `hub_env` (the verifiers Environment),
    `hub_rows` ({"train": (dataset, row indices), "test": ...}), `hub_spec`.
    """

    hub_env: Any = None
    hub_rows: dict[str, tuple[Any, list[int]]] = {}
    hub_spec: str = ""
    _loop: _Loop | None = None
    _loop_lock = threading.Lock()

    def __init__(self, **env_args: Any):
        refuse_env_args("a verifiers", self.name, self.hub_spec, env_args)
        super().__init__()
        self.state: Any = None
        self.messages: list[dict[str, Any]] = []
        self.turn = 0

    @classmethod
    def _run(cls, coro) -> Any:
        with cls._loop_lock:
            if cls._loop is None:
                cls._loop = _Loop(cls.name)
        return cls._loop.run(coro)

    def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
        _, rows = self.hub_rows["test" if split == "test" else "train"]
        return {"split": "test" if split == "test" else "train",
                "row": self.rng(f"verifiers:{split}:{seed}").choice(rows)}

    def reset(self, split: str = "train", row: int = 0, **_state: Any) -> str:
        dataset, _ = self.hub_rows.get(split) or (None, [])
        if dataset is None or not isinstance(row, int) or not 0 <= row < len(dataset):
            raise ValueError(f"state: row {row!r} is not in the {split!r} split of {self.hub_spec}")
        example = dataset[row]
        rollout_input = {k: example[k] for k in ("prompt", "answer", "task", "info", "example_id")
                         if k in example and example[k] is not None}
        env = self.hub_env
        state = self._run(env.init_state(rollout_input, None, _MODEL, {}))
        self.state = self._run(env.setup_state(state))
        self.messages = list(self.state["prompt"])
        self.turn = 0
        return ""

    def get_system_prompt(self) -> str:
        return "\n\n".join(_text(m.get("content")) for m in self.state["prompt"] if m.get("role") == "system")

    def get_initial_user_message(self) -> str:
        rest = [m for m in self.state["prompt"] if m.get("role") != "system"]
        earlier = [f"{m.get('role')}: {_text(m.get('content'))}" for m in rest[:-1]]
        return "\n\n".join([*earlier, _text(rest[-1].get("content"))] if rest else earlier)

    def get_tools(self) -> list[dict[str, Any]]:
        return list(self.state.get("oai_tools") or [])

    def step(self, action: str) -> StepResult:
        vf, env, state = _vf(), self.hub_env, self.state
        self.turn += 1
        message = assistant_message(action, bool(state.get("oai_tools")))
        step = {"prompt": self.messages, "completion": [message], "response": None, "tokens": None,
                "reward": None, "advantage": None, "is_truncated": False,
                "trajectory_id": state["trajectory_id"], "extras": {}}
        self._run(env.add_trajectory_step(state, step))
        if self._run(env.is_completed(state)):
            return self._finish("")
        try:
            messages = self._run(env.get_prompt_messages(state))
        except vf.Error as e:  # verifiers' own rollout records these and stops
            state["error"] = e
            self._run(env.is_completed(state))
            return self._finish("")
        if state.get("final_env_response") is not None:
            self._run(env.is_completed(state))
            return self._finish(self._render(state["final_env_response"]))
        new = messages[len(self.messages) + 1:]
        self.messages = list(messages)
        return StepResult(self._render(new), 0.0, False, {"turn": self.turn})

    @staticmethod
    def _render(messages: Any) -> str:
        if isinstance(messages, str):
            return messages
        return "\n\n".join(_text(m.get("content")) for m in messages)

    def _finish(self, observation: str) -> StepResult:
        env, state = self.hub_env, self.state
        self._run(env.render_completion(state))
        if env.score_rollouts:
            self._run(env.rubric.score_rollout(state))
        else:
            self._run(env.rubric.dummy_score_rollout(state))
        info = {"turn": self.turn, "metrics": dict(state.get("metrics") or {}),
                "stop_condition": state.get("stop_condition"), "example_id": state.get("example_id"),
                "answer": state.get("answer")}
        if state.get("error") is not None:
            info["error"] = f"{type(state['error']).__name__}: {state['error']}"
        return StepResult(observation, float(state.get("reward") or 0.0), True, info)

    def get_state(self) -> dict[str, Any]:
        return {"turn": self.turn, "messages": self.messages}


def _served_name(raw: str) -> str:
    return re.sub(r"[^a-z0-9_-]+", "-", raw.lower()).strip("-_") or "verifiers"


def _split_rows(env, spec: str) -> dict[str, tuple[Any, list[int]]]:
    train = env.build_dataset()
    test = env.build_eval_dataset()
    if train is None and test is None:
        raise EnvLoadError(f"--env {spec!r}: the env has neither a dataset nor an eval_dataset")
    if train is None:  # an eval-only env: hold a tenth of it out of training, as below
        train, test = test, None
    n = len(train)
    if n == 0:
        raise EnvLoadError(f"--env {spec!r}: the env's dataset is empty")
    if test is not None and len(test):
        return {"train": (train, list(range(n))), "test": (test, list(range(len(test))))}
    # No eval set: hold a seeded tenth out of training, so evaluation stays unseen.
    order = list(range(n))
    random.Random("verifiers-heldout").shuffle(order)
    k = max(1, n // 10) if n > 1 else 0
    return {"train": (train, sorted(order[k:])), "test": (train, sorted(order[:k] or order))}


def verifiers_game(spec: str, env_path: list[str] | None = None) -> type[VerifiersGame]:
    """A VerifiersGame subclass bound to the env `spec` names ("verifiers:ENV_ID[?k=v&...]"
    or "verifiers:module:function[?...]"), loaded now.

    Raises EnvLoadError naming the spec: verifiers not installed, the env not found or not a
    verifiers Environment, no data, a completion-type env, group-level reward functions.
    Errors raised by the env's own loading code propagate.
    """
    vf = _vf(spec)
    target, kwargs = split_query(spec, spec[len("verifiers:"):])
    if not target:
        raise EnvLoadError(f"--env {spec!r}: expected verifiers:ENV_ID or verifiers:module:function")
    module_name, _, func_name = target.rpartition(":")
    if module_name:
        func = getattr(import_target(module_name, spec, env_path), func_name, None)
        if not callable(func):
            raise EnvLoadError(f"--env {spec!r}: {module_name} has no function {func_name!r}")
        env = func(**kwargs)
        stem = module_name.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py").rsplit(".", 1)[-1]
        name = _served_name(stem if func_name == "load_environment" else f"{stem}-{func_name.removeprefix('load_')}")
    else:
        from opentinker.services.envhost.loader import add_env_path

        add_env_path(env_path)
        env = vf.load_environment(target, **kwargs)
        name = _served_name(target.split("/")[-1])
    if not isinstance(env, vf.Environment):
        raise EnvLoadError(f"--env {spec!r}: got {type(env).__name__}, not a verifiers Environment")
    if env.message_type != "chat":
        raise EnvLoadError(f"--env {spec!r}: message_type={env.message_type!r} is not supported "
                           "(OpenTinker's rollouts are chat)")
    group = [getattr(f, "__name__", repr(f)) for r, f in _all_funcs(env.rubric) if r._is_group_func(f)]
    if group:
        raise EnvLoadError(f"--env {spec!r}: group-level reward functions {group} are not supported "
                           "(an episode is scored on its own)")
    rows = _split_rows(env, spec)
    return type(f"Verifiers_{name.replace('-', '_')}", (VerifiersGame,),
                {"name": name, "hub_env": env, "hub_rows": rows, "hub_spec": spec, "_loop": None,
                 "__module__": __name__})
