"""Upstream OpenTinker's client classes on this service: SchedulerClient, ServiceClient,
InferenceSchedulerClient (github.com/open-tinker/OpenTinker,
opentinker/client/utils/http_training_client.py: same names, constructors, methods and
return dicts, so its client scripts run unchanged but for the URL and key).

    scheduler = SchedulerClient(scheduler_url="http://127.0.0.1:8470", api_key=KEY)
    job_id, server_url = itemgetter("job_id", "server_url")(scheduler.submit_job(config=args))
    env = GameEnvironment(game_class=MyGame, config=args, job_id=job_id)
    client = ServiceClient(server_url=server_url)
    client.set_config(args, env)
    client.fit(env=env, num_steps=args.num_steps)

How it differs underneath: upstream starts a verl server per job and streams tokenized
batches to it. Here there is no per-job server. `submit_job` checks the config (mapped
to a JobSpec, client/utils/config.py) and reserves a job id; `fit` serves the env from
this process (GameEnvironment.serve), then submits the job under that id, because the
scheduler accepts a job on a user's own env only while the user serves it, and follows
its metrics until it ends. The URL is the scheduler's REST base URL; NATS is $NATS_URL
or the local stack's; the API key is the argument, else `default_api_key()`.

Imports the SDK (opentinker.sdk), never torch, numpy, verl or requests.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import msgspec

from opentinker.client.utils.config import as_dict, env_name, get, job_spec_from_config
from opentinker.environment.inference_pipeline import forget_endpoint, register_endpoint
from opentinker.schemas.job import JOB_ID_RE, JobSpec, validate_job_spec

log = logging.getLogger("opentinker.client")


class _Loop:
    """One event loop in a daemon thread for every client of this process."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, coro) -> Any:
        """Run `coro` on the loop and return its result; Ctrl-C cancels it and re-raises."""
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, name="opentinker-client", daemon=True).start()
        fut = asyncio.run_coroutine_threadsafe(coro, cls._loop)
        try:
            return fut.result()
        except KeyboardInterrupt:
            fut.cancel()
            raise


@dataclass
class _Conn:
    """Where and as whom to connect: the REST base URL, the API key, NATS."""

    api_url: str
    api_key: str
    nats_url: str

    @classmethod
    def of(cls, url: str | None, api_key: str | None) -> _Conn:
        from opentinker.sdk.client import default_api_key
        from opentinker.services.core.config import default_api_url, default_nats_url

        url = default_api_url(url)
        if not url:
            raise ValueError("scheduler_url: pass the scheduler's REST URL (e.g. http://127.0.0.1:8470), "
                             "set OPENTINKER_API_URL, or start the local stack (`opentinker up`)")
        return cls(url.rstrip("/").removesuffix("/v1"), api_key or default_api_key(), default_nats_url(None))

    async def connect(self):
        from opentinker.sdk.client import Client

        return await Client.connect(self.nats_url, api_key=self.api_key, api_url=self.api_url)


@dataclass
class _Reservation:
    """A job id handed out by `submit_job`, before `fit` submits the job."""

    job_id: str
    conn: _Conn
    spec: JobSpec
    ignored: dict[str, str]
    wandb_key: str | None = None
    state: str = "reserved"  # reserved | submitted | completed | cancelled


_RESERVED: dict[str, _Reservation] = {}


def reserve_job_id(name: str) -> str:
    """A fresh job id `<name>-<8 hex>` ([a-z0-9][a-z0-9-]{0,62})."""
    stem = "".join(ch if ch.isalnum() else "-" for ch in env_name(name or "job")).strip("-")[:54] or "job"
    job_id = f"{stem}-{secrets.token_hex(4)}"
    assert JOB_ID_RE.match(job_id), job_id
    return job_id


def _status(rec) -> dict[str, Any]:
    """A job record as upstream's job-status dict."""
    return {"job_id": rec.job_id, "status": rec.state.value.upper(), "server_url": rec.endpoint or None,
            "vllm_server_url": rec.endpoint or None, "created_at": rec.created_s,
            "completed_at": rec.updated_s if rec.state.terminal else None,
            "error_message": rec.reason or None, "step": rec.step, "kind": rec.kind}


class _SchedulerBase:
    def __init__(self, scheduler_url: str | None = None, api_key: str | None = None, timeout: float = 600.0,
                 poll_interval: float = 2.0, *, url: str | None = None):
        self.conn = _Conn.of(scheduler_url or url, api_key)
        self.scheduler_url = self.conn.api_url
        self.api_key = api_key
        self.timeout = timeout
        self.poll_interval = poll_interval

    def _call(self, fn) -> Any:
        async def go():
            client = await self.conn.connect()
            try:
                return await fn(client)
            finally:
                await client.close()

        return _Loop.run(go())

    def get_job_status(self, job_id: str) -> dict[str, Any]:
        """The job's status dict (upstream's keys: job_id, status, server_url, ...).
        A reserved job not yet submitted is "RESERVED". Raises KeyError for no such job."""
        res = _RESERVED.get(job_id)
        if res is not None and res.state != "submitted":
            return {"job_id": job_id, "status": res.state.upper(), "server_url": self.scheduler_url}

        async def status(client):
            return _status(await client.job(job_id).record())

        return self._call(status)

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        """Cancel a job: a submitted one over the REST API, a reserved one here (its
        `fit` then refuses). Returns {"job_id", "status", "message"}."""
        return self._end(job_id, "cancelled", "cancelled by the client")

    def complete_job(self, job_id: str) -> dict[str, Any]:
        """End a job: an inference job as completed (POST /v1/jobs/{id}/complete: its
        rollout workers are free again); a train job still running is cancelled (a
        train job completes when its learner has run its steps)."""
        return self._end(job_id, "completed", "completed by the client")

    def _end(self, job_id: str, state: str, reason: str) -> dict[str, Any]:
        res = _RESERVED.get(job_id)
        if res is not None and res.state == "reserved":
            res.state = state
            return {"job_id": job_id, "status": state.upper(), "message": f"reserved job {reason}; never submitted"}
        _OPEN_INFERENCE.pop(job_id, None)
        forget_endpoint(job_id)

        async def cancel(client):
            job = client.job(job_id)
            done = state == "completed" and (await job.record()).kind == "inference"
            reply = await (job.complete(reason) if done else job.cancel(reason))
            if reply.ok:
                return {"job_id": job_id, "status": (reply.state or "cancelled").upper(), "message": reason}
            rec = await client.job(job_id).record()
            return {"job_id": job_id, "status": rec.state.value.upper(), "message": reply.error}

        return self._call(cancel)


class SchedulerClient(_SchedulerBase):
    """Upstream's SchedulerClient: `SchedulerClient(scheduler_url, api_key=None,
    timeout=600.0, poll_interval=2.0)` (or `url=`, as the project page writes it)."""

    def submit_job(self, config: Any, enable_agent_loop: bool = False, wandb_key: str | None = None,
                   num_gpus: int | None = None) -> dict[str, Any]:
        """Check `config` and reserve a job id; the job is submitted by `ServiceClient.fit`.

        Not as upstream: nothing runs yet (the env must be served first), so this
        returns at once with {"job_id", "server_url" (the scheduler URL), "status":
        "RESERVED", "message", "ignored" (config keys set aside, with reasons)}.
        `enable_agent_loop` and `num_gpus` are accepted and unused (every job runs the
        agent loop; placement is the pool's). Raises ConfigError / SpecError naming the
        key or field.
        """
        mapped = job_spec_from_config(config)
        job_id = reserve_job_id(get(config, "experiment_name") or get(config, "interaction.name") or "job")
        _RESERVED[job_id] = _Reservation(job_id, self.conn, mapped.spec, mapped.ignored,
                                         wandb_key or get(config, "wandb_key"))
        return {"job_id": job_id, "server_url": self.scheduler_url, "status": "RESERVED",
                "message": "job id reserved: ServiceClient.fit serves the env and submits the job",
                "ignored": mapped.ignored}


def plan_job(spec: JobSpec, env: Any, num_epochs: int | None = None, num_steps: int | None = None,
             save_freq: int = 100, test_freq: int = 50, validate_before_training: bool = True) -> JobSpec:
    """The spec `fit` submits: `spec` on `env`'s name with upstream's fit arguments:
    steps (num_steps, else num_epochs (default 1) epochs of the env's steps per epoch),
    checkpoint_every (save_freq; <= 0: none before the end), eval_every (test_freq when
    the env has validation, else 0) with the env's eval_episodes. Evaluation also runs
    before training whenever it is on. Raises SpecError naming the field."""
    from opentinker.environment.base_game_environment import epochs_to_steps

    steps = epochs_to_steps(env, num_epochs, num_steps)
    every = save_freq if save_freq and save_freq > 0 else 1_000_000
    evaluate = bool(test_freq and test_freq > 0 and env.has_validation)
    if evaluate and not validate_before_training:
        log.info("validate_before_training=False: evaluation (eval_every) here also runs before the first step")
    spec = msgspec.structs.replace(spec, env=env.interaction_name, steps=steps, checkpoint_every=min(every, 1_000_000),
                                   eval_every=int(test_freq) if evaluate else 0,
                                   eval_episodes=env.eval_episodes if evaluate else spec.eval_episodes)
    return validate_job_spec(spec)


class ServiceClient:
    """Upstream's ServiceClient: `ServiceClient(server_url, project_name=None,
    experiment_name=None, logger_backends=None, **client_kwargs)`. `server_url` is what
    `submit_job` returned (the scheduler URL); `api_key=` may be among client_kwargs
    (else the key `submit_job` used, else the default key)."""

    def __init__(self, server_url: str, project_name: str | None = None, experiment_name: str | None = None,
                 logger_backends: list[str] | None = None, **client_kwargs: Any):
        self.server_url = server_url
        self.project_name, self.experiment_name = project_name, experiment_name
        self.logger_backends = list(logger_backends or [])
        self._api_key = client_kwargs.get("api_key")
        self._args: Any = None
        self._env: Any = None

    def set_config(self, args: Any, env: Any = None) -> None:
        """Keep the run's config and env for `fit`; checks the config now (ConfigError /
        SpecError naming the key or field)."""
        job_spec_from_config(args, env=getattr(env, "interaction_name", None))
        self._args, self._env = args, env

    def upload_reward_function(self, function_name: str, source_code: str) -> None:
        """Upstream uploads reward code to its server; here the reward is the game's
        `step()`, so this raises NotImplementedError."""
        raise NotImplementedError("reward functions are not uploaded here: return the reward from the game's step()")

    def _reservation(self, env: Any) -> _Reservation:
        res = _RESERVED.get(getattr(env, "job_id", None) or "")
        if res is None:
            config = self._args if self._args is not None else env.config
            mapped = job_spec_from_config(config, env=env.interaction_name)
            conn = _Conn.of(self.server_url, self._api_key or get(config, "scheduler_api_key"))
            res = _Reservation(reserve_job_id(get(config, "experiment_name") or env.interaction_name), conn,
                               mapped.spec, mapped.ignored, get(config, "wandb_key"))
            _RESERVED[res.job_id] = res
        if res.state != "reserved":
            raise RuntimeError(f"job {res.job_id} was {res.state} before fit; reserve another with submit_job")
        if self._args is not None:
            res.spec = job_spec_from_config(self._args, env=env.interaction_name).spec
        return res

    def fit(self, env: Any, num_epochs: int | None = None, num_steps: int | None = None, save_freq: int = 100,
            test_freq: int = 50, validate_before_training: bool = True, verbose: bool = True,
            game_stats_client: Any = None, game_stats_log_freq: int = 1, **ignored: Any) -> dict[str, float]:
        """Train on `env` (a GameEnvironment): serve it, submit the job, show each step's
        reward until the job ends, stop serving. Upstream's arguments (`plan_job`);
        `game_stats_client` is not needed: the env's episodes are recorded in this
        process under its job id as they end (a GameStatsClient of that id reads them),
        and the per-step figures are in the job's metrics. Returns the last train step's
        metrics plus "step" (the job's step index). Raises RuntimeError with the job's
        reason when it fails or is cancelled; Ctrl-C cancels the job."""
        res = self._reservation(env)
        spec = plan_job(res.spec, env, num_epochs, num_steps, save_freq, test_freq, validate_before_training)
        if ignored:
            log.info("fit: %s not used here", ", ".join(sorted(ignored)))
        env.serve(nats_url=res.conn.nats_url, api_key=res.conn.api_key, api_url=res.conn.api_url)
        try:
            rec, last = _Loop.run(self._follow(res, spec, verbose))
        except KeyboardInterrupt:
            if res.state == "submitted":
                SchedulerClient(res.conn.api_url, res.conn.api_key).cancel_job(res.job_id)
            raise
        finally:
            env.stop()
        if rec.state.value != "completed":
            raise RuntimeError(f"job {rec.job_id} {rec.state.value}: {rec.reason}")
        return {**last.values, "step": last.step} if last is not None else {}

    def _bridge(self, client, res: _Reservation):
        """A WandbBridge task when logger_backends asks for wandb (with project and
        experiment names), else None."""
        others = [b for b in self.logger_backends if b not in ("console", "wandb")]
        if others:
            log.info("logger_backends %s not supported here (console and wandb are)", others)
        if "wandb" not in self.logger_backends:
            return None
        if not (self.project_name and self.experiment_name):
            log.info("wandb: needs project_name and experiment_name, as upstream's tracker does; not logging")
            return None
        try:
            import wandb  # noqa: F401
        except ImportError:
            log.warning("wandb is not installed (pip install 'opentinker[wandb]'): not logging to wandb")
            return None
        from opentinker.sdk.wandb_bridge import WandbBridge

        if res.wandb_key:
            os.environ.setdefault("WANDB_API_KEY", res.wandb_key)
        bridge = WandbBridge(client, res.job_id, project=self.project_name,
                             config={"experiment_name": self.experiment_name})
        return asyncio.ensure_future(bridge.follow())

    async def _follow(self, res: _Reservation, spec: JobSpec, verbose: bool):
        client = await res.conn.connect()
        try:
            job = await client.submit(spec, job_id=res.job_id)
            res.state = "submitted"
            bridge = self._bridge(client, res)
            last = None
            with _Display(job.id, spec.steps, verbose) as display:
                async for m in job.metrics():
                    display.show(m)
                    if m.split == "train":
                        last = m
            rec = await job.wait(raise_on_failure=False)
            if bridge is not None:
                await bridge
            return rec, last
        finally:
            await client.close()


class _Display:
    """Each step's reward: a rich progress bar (verbose) or one plain line per step."""

    def __init__(self, job_id: str, steps: int, verbose: bool):
        self.job_id, self.steps, self.verbose = job_id, steps, verbose
        self.progress = None

    def __enter__(self) -> _Display:
        if self.verbose:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("reward {task.fields[reward]}"), TimeElapsedColumn())
            self.progress.__enter__()
            self.task = self.progress.add_task(self.job_id, total=self.steps, reward="-")
        else:
            print(f"job {self.job_id}: training for {self.steps} steps")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def show(self, m) -> None:
        v = m.values
        key = "reward_mean" if "reward_mean" in v else "loss"
        line = (f"{'eval after' if m.split == 'eval' else 'step'} {m.step:>4}  {key} {v.get(key, 0.0):.3f}"
                + "".join(f"  {k} {v[k]:.3f}" for k in ("reward_std", "correct_frac", "kl") if k in v))
        if self.progress is None:
            print(line, flush=True)
            return
        self.progress.console.print(line)
        if m.split == "train":
            self.progress.update(self.task, completed=m.step + 1, reward=f"{v.get(key, 0.0):.3f}")


# inference jobs this process started and has not ended: cancelled at exit, as
# upstream's lifecycle manager does
_OPEN_INFERENCE: dict[str, _Conn] = {}


def _cancel_open_inference() -> None:
    for job_id, conn in list(_OPEN_INFERENCE.items()):
        try:
            InferenceSchedulerClient(conn.api_url, conn.api_key).cancel_job(job_id)
        except Exception as e:  # at exit: report, and go on to the next job
            log.warning("could not cancel inference job %s at exit: %s", job_id, e)


atexit.register(_cancel_open_inference)


class InferenceSchedulerClient(_SchedulerBase):
    """Upstream's InferenceSchedulerClient: `InferenceSchedulerClient(scheduler_url,
    api_key=None, timeout=600.0, poll_interval=2.0)` (or `url=`). Inference jobs it
    starts are cancelled when the process exits, unless ended before."""

    def submit_inference_job(self, model_path: str, tokenizer_path: str | None = None,
                             tensor_parallel_size: int = 1, num_gpus: int | None = None,
                             gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                             trust_remote_code: bool = True) -> dict[str, Any]:
        """Serve a model as an OpenAI-compatible endpoint; waits until it is placed.

        `model_path`: one of your train jobs' id (its newest policy is served) or a
        model (a Hugging Face id, a path, "smollm2-135m-instruct"). The engine
        arguments are accepted and unused (the rollout worker's engine is the
        operator's). Returns {"job_id", "vllm_server_url" (the endpoint's base URL,
        ".../v1"), "server_url", "status": "RUNNING", "api_key" (its bearer token),
        "model"}. Raises SpecError naming the field, TimeoutError past `timeout`.
        """
        unused = {k: v for k, v, default in (("tokenizer_path", tokenizer_path, None),
                                             ("tensor_parallel_size", tensor_parallel_size, 1),
                                             ("num_gpus", num_gpus, None),
                                             ("gpu_memory_utilization", gpu_memory_utilization, 0.9),
                                             ("max_model_len", max_model_len, None),
                                             ("trust_remote_code", trust_remote_code, True))
                  if v != default and not (k == "tokenizer_path" and v == model_path)}
        if unused:
            log.info("submit_inference_job: %s not used (the model's own tokenizer and the operator's engine)",
                     ", ".join(sorted(unused)))

        async def submit(client):
            model, policy_of = model_path, ""
            if JOB_ID_RE.match(model_path):
                try:
                    rec = await client.job(model_path).record()
                except KeyError:
                    rec = None
                if rec is not None:
                    if rec.kind != "train":
                        raise ValueError(f"model_path: job {model_path} is an {rec.kind} job, not a train job")
                    model, policy_of = rec.spec.model, model_path
            try:
                return await client.submit_inference_job(model=model, policy_of=policy_of, timeout_s=self.timeout)
            except asyncio.TimeoutError as e:
                raise TimeoutError(str(e)) from None

        ep = self._call(submit)
        register_endpoint(ep.id, ep.url, ep.token, ep.model)
        _OPEN_INFERENCE[ep.id] = self.conn
        return {"job_id": ep.id, "vllm_server_url": ep.url, "server_url": ep.url, "status": "RUNNING",
                "api_key": ep.token, "model": ep.model}


class HTTPTrainingClient:
    """Upstream's low-level client of its per-job verl server (train_step on tokenized
    batches). This service has no such server: it trains from the env it is given, so
    constructing one raises NotImplementedError pointing at ServiceClient.fit."""

    def __init__(self, server_url: str, *args: Any, **kwargs: Any):
        raise NotImplementedError("HTTPTrainingClient drives upstream's per-job verl server; here the service "
                                  "trains from the env: use ServiceClient(server_url).fit(env=...)")


__all__ = ["HTTPTrainingClient", "InferenceSchedulerClient", "SchedulerClient", "ServiceClient", "as_dict",
           "plan_job"]
