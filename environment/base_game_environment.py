"""A game class and its data, served from the caller's process as the user's own env,
at upstream OpenTinker's import path (`opentinker.environment.base_game_environment`).

Upstream OpenTinker (github.com/open-tinker/OpenTinker) builds tokenized dataloaders on
the client and points a per-job server at a separately started env server. Here
`GameEnvironment` keeps upstream's constructor and attributes, and `serve()` serves the
game from this process (services/envhost/tenant.py, a background thread): a job of
this user naming the env (`interaction_name`) runs its episodes against it.

- The served class is a subclass of `game_class` whose constructor merges `game_kwargs`
  with the job's `env_args` (the job's win), so the kwargs never leave this process.
- A data-dependent env (`data_path` / `val_data_path` in the config, or `data_paths=` /
  `val_data_paths=`): the Parquet or JSON(L) rows are read here
  (static_data_generator.py, upstream's rules) and stay here. A group's state names
  only a row: row `seed % n` of the train rows for split "train", of the validation
  rows (the train rows when there are none) for any other split. The episode's system
  prompt and first user message are the row's prompt (the game's system prompt unless
  the row has one), and `reset` gets the row's `ground_truth`, `extra_info` and
  `data_source`, as upstream's math env passes them. A row's `images` (a vision-language
  dataset such as upstream's Geo3K) are the episode's initial images.
- `interaction.config.observation_template` (upstream's GymEnvironmentInteraction):
  each step's observation is sent as `template.format(observation=, reward=, step=,
  cumulative_reward=, **info)`, step counting from 1; the opening observation is not
  formatted, as upstream.
"""

from __future__ import annotations

import math
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.environment.inference_pipeline import INFER_SPLIT, game_initial_state, game_opening
from opentinker.environment.static_data_generator import read_rows, sample_from_row

ROW, SPLIT = "_ot_row", "_ot_split"  # the group state of a data-dependent env
GAME_STEPS_PER_EPOCH = 100  # upstream's virtual epoch of a game without data: 100 batches
GAME_VAL_EPISODES = 50      # upstream's val_batch_size default for a game
DATA_VAL_EPISODES = 64      # upstream's cap on a dataset's validation batch


@dataclass
class InteractionSpec:
    """Upstream's description of an env for its server (name, class path, config)."""

    name: str
    class_path: str
    config: dict[str, Any] = field(default_factory=dict)

    def to_config_dict(self) -> dict[str, Any]:
        return {"name": self.name, "class_name": self.class_path, "config": self.config}


def _cfg(config: Any) -> dict[str, Any]:
    from opentinker.client.utils.config import as_dict

    return as_dict(config)


def _user_text(prompt: list[dict[str, str]], where: str) -> str:
    """The opening user message of a row's prompt. Raises ValueError for a prompt with
    an assistant turn (an episode here opens with one system and one user message)."""
    turns = [m for m in prompt if m["role"] != "system"]
    if any(m["role"] != "user" for m in turns):
        raise ValueError(f"{where}: the prompt has a {[m['role'] for m in turns if m['role'] != 'user'][0]!r} "
                         "message; an episode opens with a system prompt and user messages only")
    return "\n\n".join(m["content"] for m in turns)


def bind_game(game_class: type[AbstractGame], game_kwargs: dict[str, Any] | None = None,
              train: list[dict[str, Any]] | None = None,
              val: list[dict[str, Any]] | None = None, stats_job: str | None = None,
              observation_template: str = "{observation}") -> type[AbstractGame]:
    """The class to serve: `game_class` with `game_kwargs` bound (the job's env_args
    override them) and, with `train` samples (static_data_generator's), the rows as
    above; with `stats_job`, each episode is recorded under that job id when it ends
    (GameStatsClient); each step's observation formatted with `observation_template`
    (module docstring). The subclass keeps the game's name. Raises ValueError for a
    template that is no format string."""
    kwargs = dict(game_kwargs or {})
    template = check_template(observation_template)

    def __init__(self, **env_args: Any) -> None:
        game_class.__init__(self, **{**kwargs, **env_args})

    attrs: dict[str, Any] = {"__init__": __init__, "__module__": game_class.__module__,
                             "__qualname__": game_class.__qualname__, "__doc__": game_class.__doc__}
    if train:
        rows = {"train": train, "val": val or train}

        def sample(state: dict[str, Any]) -> dict[str, Any]:
            got = rows["train" if state.get(SPLIT) == "train" else "val"]
            return got[int(state.get(ROW, 0)) % len(got)]

        def generate_initial_state(self, seed: int, split: str = "train") -> dict[str, Any]:
            part = "train" if split == "train" else "val"
            return {ROW: seed % len(rows[part]), SPLIT: part}

        def get_user_message_with_state(self, **state: Any) -> str:
            return _user_text(sample(state)["prompt"], "row")

        def reset(self, **state: Any) -> str:
            s = sample(state)
            self._ot_system = next((m["content"] for m in s["prompt"] if m["role"] == "system"), None)
            self._ot_images = s.get("images") or []
            rest = {k: v for k, v in state.items() if k not in (ROW, SPLIT)}
            return game_class.reset(self, **{**s["env_kwargs"], **rest})

        def get_system_prompt(self) -> str:
            system = getattr(self, "_ot_system", None)
            return system if system is not None else game_class.get_system_prompt(self)

        def get_initial_images(self) -> list[Any]:
            return getattr(self, "_ot_images", None) or game_class.get_initial_images(self)

        attrs.update(generate_initial_state=generate_initial_state, reset=reset, get_system_prompt=get_system_prompt,
                     get_user_message_with_state=get_user_message_with_state, get_initial_images=get_initial_images)
    if template != "{observation}":
        def step(self, action: str) -> StepResult:
            r = game_class.step(self, action)
            n, total = getattr(self, "_ot_steps", (0, 0.0))
            self._ot_steps = (n + 1, total + float(r.reward))
            fields = {**r.info, "observation": r.observation, "reward": r.reward, "step": n + 1,
                      "cumulative_reward": total + float(r.reward)}
            try:
                text = template.format(**fields)
            except (KeyError, IndexError, AttributeError) as e:
                raise ValueError(f"interaction.config.observation_template {template!r}: no field {e} in this "
                                 f"step (observation, reward, step, cumulative_reward and the info's keys: "
                                 f"{sorted(r.info)})") from None
            return StepResult(text, r.reward, r.done, r.info, r.images)

        attrs["step"] = step
    served = type(game_class.__name__, (game_class,), attrs)
    return _recording(served, stats_job) if stats_job else served


def check_template(template: str | None) -> str:
    """`template` (None: "{observation}") if it is a format string; ValueError naming
    interaction.config.observation_template otherwise."""
    template = template or "{observation}"
    try:
        list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"interaction.config.observation_template {template!r}: {e}") from None
    return template


def _recording(cls: type[AbstractGame], job_id: str) -> type[AbstractGame]:
    """`cls` whose episodes are recorded under `job_id` (game_stats_client.py) when the
    env host closes them (it does once an episode ends, or is dropped): the last step's
    reward, the summed reward, the steps, and whether the game said done."""
    from opentinker.environment.game_stats_client import record_episode

    def step(self, action: str):
        r = cls.step(self, action)
        total, n, _, _ = getattr(self, "_ot_episode", (0.0, 0, 0.0, False))
        self._ot_episode = (total + float(r.reward), n + 1, float(r.reward), bool(r.done))
        return r

    def close(self) -> None:
        episode, self._ot_episode = getattr(self, "_ot_episode", None), None
        if episode is not None:
            total, n, last, done = episode
            record_episode(job_id, last, total, n, done)
        closer = getattr(cls, "close", None)
        if callable(closer):
            closer(self)

    return type(cls.__name__, (cls,), {"step": step, "close": close, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})


class SampleBatches:
    """A sized iterable of batches of samples ({"prompt", "env_kwargs", "data_source"}),
    standing in for upstream's dataloaders: `len()` is the batches of one epoch."""

    def __init__(self, sample_of, n_batches: int, batch_size: int):
        self._sample_of = sample_of
        self.n_batches, self.batch_size = n_batches, batch_size

    def __len__(self) -> int:
        return self.n_batches

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        for b in range(self.n_batches):
            yield [self._sample_of(b * self.batch_size + i) for i in range(self.batch_size)]


class GameEnvironment:
    """A game served from this process for a job; upstream OpenTinker's GameEnvironment.

    Args: `game_class` (an AbstractGame subclass), `config` (upstream's client config:
    dict, DictConfig or namespace), `game_kwargs` (the game's constructor kwargs),
    `reward_function` (must be None: the reward is the game's `step()`), `job_id`,
    `data_paths` / `val_data_paths` (else the config's `data_path` / `val_data_path`),
    `image_key` (the rows' column of images, for a vision-language model).

    Raises ValueError for a reward function or a dataset row this env cannot open an
    episode with, ImportError naming pyarrow for Parquet without it.
    """

    def __init__(self, game_class: type[AbstractGame], config: Any, game_kwargs: dict[str, Any] | None = None,
                 reward_function: Any = None, job_id: str | None = None, *,
                 data_paths: str | list[str] | None = None, val_data_paths: str | list[str] | None = None,
                 image_key: str = "images"):
        from opentinker.client.utils.config import env_name

        if reward_function is not None:
            raise ValueError("reward_function: not supported here; the reward is what the game's step() returns")
        self.game_class = game_class
        self.config = config
        self.game_kwargs = dict(game_kwargs or {})
        self.reward_function = None
        self.image_key = image_key
        cfg = _cfg(config)
        self._game_instance = game_class(**self.game_kwargs)
        name = (cfg.get("interaction") or {}).get("name") or self._game_instance.get_interaction_name()
        self.interaction_name = env_name(str(name))
        inter = (cfg.get("interaction") or {}).get("config")
        src = inter if isinstance(inter, dict) else cfg
        self.env_endpoint = src.get("env_endpoint") or "http://localhost:8081"
        self.max_steps = src.get("max_steps") or 100
        self.observation_template = src.get("observation_template") or "{observation}"
        self.job_id = job_id or src.get("job_id") or "default"
        served_config = {**(inter if isinstance(inter, dict) else {}), "job_id": self.job_id}
        self.interaction_specs = [InteractionSpec(self.interaction_name, "opentinker.services.envhost.tenant",
                                                  served_config)]
        self.batch_size = int(cfg.get("batch_size") or 4)
        self.train_samples = self._load(data_paths or cfg.get("data_path"))
        self.val_samples = self._load(val_data_paths or cfg.get("val_data_path"))
        self.served_class = bind_game(game_class, self.game_kwargs, self.train_samples, self.val_samples,
                                      stats_job=self.job_id, observation_template=self.observation_template)
        self._val_size = cfg.get("val_batch_size")
        self._steps = cfg.get("num_steps")
        self.train_dataloader, self.val_dataloader = self._loaders()
        self._host = None

    def _load(self, paths: str | list[str] | None) -> list[dict[str, Any]] | None:
        paths = [p for p in ([paths] if isinstance(paths, str) else list(paths or [])) if p]
        if not paths:
            return None
        system = self._game_instance.get_system_prompt()
        out = []
        for path in paths:
            for i, row in enumerate(read_rows(path)):
                s = sample_from_row(row, self.interaction_name, system, image_key=self.image_key)
                _user_text(s["prompt"], f"{path} row {i}")
                out.append(s)
        if not out:
            raise ValueError(f"data {paths}: no rows")
        return out

    @property
    def has_data(self) -> bool:
        """Whether episodes open with dataset rows (else the game makes its own states)."""
        return self.train_samples is not None

    @property
    def has_validation(self) -> bool:
        """Whether the job evaluates: a dataset env with validation rows, or any game
        without data (upstream generates a validation batch for those)."""
        return not self.has_data or self.val_samples is not None

    @property
    def steps_per_epoch(self) -> int:
        """Steps of one epoch: the train rows over batch_size (at least 1), or, for a
        game without data, the config's num_steps or upstream's 100."""
        return len(self.train_dataloader)

    @property
    def eval_episodes(self) -> int:
        """Validation episodes: val_batch_size, else 50 for a game, min(64, rows) for data."""
        if self._val_size:
            return int(self._val_size)
        return min(DATA_VAL_EPISODES, len(self.val_samples)) if self.val_samples else GAME_VAL_EPISODES

    def _loaders(self) -> tuple[SampleBatches, SampleBatches | None]:
        if self.has_data:
            train = SampleBatches(lambda i: self.train_samples[i % len(self.train_samples)],
                                  max(1, len(self.train_samples) // self.batch_size), self.batch_size)
            val = (SampleBatches(lambda i: self.val_samples[i % len(self.val_samples)], 1, self.eval_episodes)
                   if self.val_samples else None)
            return train, val
        steps = int(self._steps or GAME_STEPS_PER_EPOCH)
        return (SampleBatches(lambda i: self._game_sample(i, "train"), steps, self.batch_size),
                SampleBatches(lambda i: self._game_sample(42 + i, INFER_SPLIT), 1, self.eval_episodes))

    def _game_sample(self, seed: int, split: str) -> dict[str, Any]:
        game = self.served_class()
        state = game_initial_state(game, seed, split)
        system, user = game_opening(game, state)
        prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return {"prompt": prompt, "env_kwargs": state, "data_source": self.interaction_name}

    def serve(self, nats_url: str | None = None, api_key: str | None = None, api_url: str | None = None):
        """Serve the game from this process as the user's env `interaction_name`
        (idempotent). Connection: the arguments, else the config's scheduler_url /
        scheduler_api_key, else $NATS_URL / $OPENTINKER_API_URL / the default key
        (services/core/config.py).
        Returns the TenantEnvHost; raises RuntimeError/PermissionError naming the problem."""
        if self._host is not None:
            return self._host
        from opentinker.services.envhost.tenant import start_in_thread

        cfg = _cfg(self.config)
        self._host = start_in_thread({self.interaction_name: self.served_class}, nats_url=nats_url,
                                     api_key=api_key or cfg.get("scheduler_api_key"),
                                     api_url=api_url or cfg.get("scheduler_url"))
        return self._host

    @property
    def serving(self) -> bool:
        return self._host is not None

    def stop(self) -> None:
        """Stop serving (no-op when not serving)."""
        host, self._host = self._host, None
        if host is not None:
            host.stop()

    def cleanup(self) -> None:
        """Upstream's teardown: stop serving."""
        self.stop()

    def get_dataloader(self) -> tuple[SampleBatches, SampleBatches | None]:
        """(train, validation) batches of samples; upstream's `get_dataloader()`."""
        return self.train_dataloader, self.val_dataloader

    def get_interaction_config_path(self) -> str | None:
        """None: no interaction config file is written here (upstream writes a temp YAML)."""
        return None

    def get_interaction_config_content(self) -> str | None:
        return None

    def get_config(self) -> dict[str, Any]:
        """What the job is told about the env: its served name (and how much data)."""
        out: dict[str, Any] = {"env": self.interaction_name, "env_args": {}}
        if self.has_data:
            out["data"] = {"train_rows": len(self.train_samples), "val_rows": len(self.val_samples or [])}
        return out

    def setup(self, client: Any = None) -> dict[str, Any]:
        """Upstream's hook before training; returns `get_config()`."""
        return self.get_config()


def create_game_environment(game_class: type[AbstractGame], config: Any, **game_kwargs: Any) -> GameEnvironment:
    """A GameEnvironment for `game_class` with `game_kwargs` (upstream's helper)."""
    return GameEnvironment(game_class, config, game_kwargs=game_kwargs)


def epochs_to_steps(env: GameEnvironment, num_epochs: int | None, num_steps: int | None) -> int:
    """Training steps for upstream's `fit(num_epochs=, num_steps=)`: num_steps when
    given, else num_epochs (default 1) times the env's steps per epoch."""
    if num_steps:
        return int(num_steps)
    return math.ceil((num_epochs or 1) * env.steps_per_epoch)
