"""`opentinker` command line.

    opentinker up                      local NATS + every service (Ctrl-C stops all)
    opentinker train CONFIG.toml [--up] [--set KEY=VALUE]   submit a job, show progress
    opentinker jobs | cancel JOB       list jobs, cancel one
    opentinker query "SQL"             DuckDB over the trajectory log (views trajectories, metrics, events)
    opentinker infer [CONFIG.toml] --env E [--adapter DIR | --job JOB]   run a policy on an env
    opentinker envhost --env mod:Class serve a user environment
    opentinker serve NAME [KEY=VALUE]  run one service (scheduler, rollout, learner, envhost, recorder)
    opentinker data gsm8k              GSM8K JSONL -> Parquet for the gsm8k environment
    opentinker models prepare [MODEL]  convert/resolve a model once
    opentinker serve-model [--adapter PATH | --job JOB]  OpenAI-compatible endpoint (vLLM)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import signal
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

SERVICE_NAMES = ("scheduler", "rollout", "learner", "envhost", "recorder")


def _home() -> str:
    from opentinker.services.core.config import default_home

    return default_home()


def _nats_url(args: argparse.Namespace) -> str:
    from opentinker.sdk.stack import discover_nats_url

    return args.nats_url or discover_nats_url(_home()) or "nats://127.0.0.1:4222"


def _console():
    """A rich console; when output is not a terminal (pipes, CI), wide enough that
    tables are never truncated."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=240)


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def load_job_config(path: str, sets: list[str]) -> dict[str, Any]:
    """A job spec as plain data: the TOML file, then `--set a.b=value` overrides."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _parse_value(raw)
    return data


# -- train ----------------------------------------------------------------------------


async def _submit_with_retry(client, spec: dict, job_id: str, wait_s: float):
    """Submit, retrying while no scheduler answers yet (the stack is starting)."""
    import nats

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await client.submit(spec, job_id=job_id)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def _train(args: argparse.Namespace, nats_url: str) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from opentinker.sdk.client import Client
    from opentinker.schemas.job import SpecError

    console = _console()
    spec = load_job_config(args.config, args.set)
    client = await Client.connect(nats_url)
    try:
        try:
            job = await _submit_with_retry(client, spec, args.job_id, 120 if args.up else 10)
        except SpecError as e:
            console.print(f"[red]refused:[/] {e}")
            return 2
        console.print(f"job [bold]{job.id}[/] submitted to {nats_url}")
        if args.detach:
            print(job.id)
            return 0
        bridge = None
        if args.wandb:
            from opentinker.sdk.wandb_bridge import WandbBridge

            bridge = asyncio.ensure_future(WandbBridge(client, job.id).follow())
        rewards: list[float] = []
        total = spec.get("steps", 20)
        cols = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]}"), TextColumn("step {task.fields[step_s]}"),
                TimeElapsedColumn()]
        with Progress(*cols, console=console, transient=False) as progress:
            task = progress.add_task(job.id, total=total, reward="-", step_s="-")
            async for m in job.metrics():
                v = m.values
                if m.split == "eval":
                    progress.console.print(
                        f"eval after {m.step:>3} steps  reward {v.get('reward_mean', 0):.3f}"
                        f"  correct {v.get('correct_frac', 0):.3f}  ({v.get('episodes', 0):.0f} episodes)")
                    continue
                if m.split != "train":
                    continue
                if "reward_mean" not in v:  # an SFT job: loss, not reward
                    progress.update(task, completed=m.step + 1, reward=f"loss {v.get('loss', 0):.3f}",
                                    step_s=f"{v.get('step_time_s', 0):.1f}s")
                    extra = "".join(f"  {k} {v[k]:.4f}" for k in ("loss_full_before", "loss_full_after") if k in v)
                    progress.console.print(f"step {m.step:>3}  loss {v.get('loss', 0):.4f}  "
                                           f"grad_norm {v.get('grad_norm', 0):.3f}{extra}")
                    continue
                rewards.append(v.get("reward_mean", float("nan")))
                progress.update(task, completed=m.step + 1, reward=f"{v.get('reward_mean', 0):.3f}",
                                step_s=f"{v.get('step_time_s', 0):.1f}s")
                progress.console.print(
                    f"step {m.step:>3}  reward {v.get('reward_mean', 0):.3f} ± {v.get('reward_std', 0):.3f}"
                    f"  kl {v.get('kl', 0):.4f}  entropy {v.get('entropy', 0):.3f}"
                    f"  clip {v.get('clip_frac', 0):.3f}  lag {v.get('policy_lag_mean', 0):.2f}"
                    f"  {v.get('tokens_per_s', 0):.0f} tok/s  {v.get('step_time_s', 0):.1f}s/step")
        rec = await job.wait(raise_on_failure=False)
        if bridge is not None:
            await bridge
            console.print(f"wandb run {job.id} logged ({bridge.result().state.value})")
        console.print(f"job {job.id} {rec.state.value} at step {rec.step} {rec.reason}")
        if len(rewards) >= 2:
            k = min(5, len(rewards) // 2)
            first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
            console.print(f"mean reward: first {k} steps {first:.3f}, last {k} steps {last:.3f}, "
                          f"change {last - first:+.3f}")
        return 0 if rec.state.value == "completed" else 1
    finally:
        await client.close()


def _run_client(args: argparse.Namespace, body) -> int:
    """asyncio.run(body(args, nats_url)), against the embedded stack (started for the
    command and stopped after it) with --up, else the configured NATS server."""
    if not args.up:
        return asyncio.run(body(args, _nats_url(args)))
    from opentinker.sdk.stack import Stack

    stack = Stack(_home(), nats_url=os.environ.get("NATS_URL") or None).start()
    print(f"stack up: NATS {stack.nats_url}, logs in {stack.log_dir}", flush=True)
    try:
        return asyncio.run(body(args, stack.nats_url))
    finally:
        stack.stop()


def cmd_train(args: argparse.Namespace) -> int:
    return _run_client(args, _train)


# -- infer ------------------------------------------------------------------------------


def infer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `infer` keyword arguments from CONFIG (a job spec: env, env_args, model,
    sampling limits) and the flags, flags winning. Sampling is greedy unless
    --temperature is given. Raises SystemExit naming a bad flag."""
    from opentinker.schemas import SamplingParams
    from opentinker.schemas.job import SpecError, spec_from_dict

    base: dict[str, Any] = {}
    if args.config:
        try:
            spec = spec_from_dict(load_job_config(args.config, []), "inference")
        except SpecError as e:
            raise SystemExit(f"{args.config}: {e}") from None
        base = {"env": spec.env, "env_args": dict(spec.env_args), "model": spec.model,
                "sampling": spec.sampling}
    env_args = dict(base.get("env_args", {}))
    for item in args.env_arg:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--env-arg {item!r}: expected KEY=VALUE")
        env_args[key] = _parse_value(raw)
    env = args.env or base.get("env")
    if not env:
        raise SystemExit("--env: name the environment (or pass a job CONFIG.toml)")
    s = base.get("sampling") or SamplingParams(max_new_tokens=256, max_total_tokens=2048)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=s.top_p if args.temperature > 0 else 1.0,
        max_new_tokens=args.max_new_tokens or s.max_new_tokens,
        max_total_tokens=max(s.max_total_tokens, (args.max_new_tokens or 0) + 1),
        max_turns=args.max_turns or s.max_turns)
    return dict(env=env, env_args=env_args, model=args.model or (None if args.job else base.get("model")),
                adapter=args.adapter, job=args.job, episodes=args.episodes, group_size=args.group_size,
                split=args.split, seed=args.seed, sampling=sampling, engine=args.engine,
                timeout_s=args.timeout)


async def _infer(args: argparse.Namespace, nats_url: str) -> int:
    from rich.table import Table

    from opentinker.sdk.client import Client
    from opentinker.sdk.infer import InferError, infer, new_run_id

    kw = infer_settings(args)
    run_id = args.run_id or new_run_id()
    out_dir = args.out or str(Path(_home()) / "infer" / run_id)
    console = _console()
    client = await Client.connect(nats_url)
    n = 0

    def progress(t) -> None:
        nonlocal n
        n += 1
        if n % max(1, args.episodes // 10) == 0 or n == args.episodes:
            console.print(f"  {n}/{args.episodes} episodes")

    try:
        console.print(f"inference run [bold]{run_id}[/]: {kw['env']} ({kw['split']}), "
                      f"{kw['model'] or '(the job model)'}"
                      f"{' + ' + (kw['adapter'] or 'job ' + kw['job']) if kw['adapter'] or kw['job'] else ''}")
        try:
            res = await infer(client, run_id=run_id, out_dir=out_dir, on_episode=progress, **kw)
        except (InferError, ValueError) as e:
            console.print(f"[red]inference failed:[/] {e}")
            return 1
    finally:
        await client.close()
    t = Table("metric", "value")
    for k, v in res.summary.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            t.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    console.print(t)
    console.print(f"results in {res.out_dir}")
    return 0


def cmd_infer(args: argparse.Namespace) -> int:
    return _run_client(args, _infer)


# -- up ---------------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    from opentinker.sdk.stack import SERVICES, Stack

    services = tuple(s for s in SERVICES if s not in args.without)
    stack = Stack(_home(), nats_url=os.environ.get("NATS_URL") or None, services=services).start()
    print(f"OpenTinker up: NATS {stack.nats_url} (JetStream in {stack.home / 'nats'})")
    if stack.api_url:
        print(f"  REST API and dashboard {stack.api_url} (admin key in {stack.home / 'admin.key'})")
    for name, p in stack.procs.items():
        print(f"  {name:<10} pid {p.pid:<8} log {stack.log_dir / (name + '.log')}")
    print("Ctrl-C stops everything.", flush=True)
    stopping = False

    def _stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        while not stopping:
            time.sleep(0.5)
            for name, p in list(stack.procs.items()):
                if p.poll() is not None and not stopping:
                    # a service can be killed and restarted at any time (DESIGN.md)
                    print(f"{name} exited with {p.returncode}; restarting", flush=True)
                    time.sleep(1.0)
                    stack.spawn(name)
    finally:
        print("stopping...", flush=True)
        stack.stop()
    return 0


# -- small commands ----------------------------------------------------------------------


def cmd_jobs(args: argparse.Namespace) -> int:
    from rich.table import Table

    from opentinker.sdk.client import SyncClient

    c = SyncClient(_nats_url(args))
    try:
        recs = c.jobs()
    finally:
        c.close()
    t = Table("job", "state", "step", "steps", "model", "env", "reason")
    for r in recs:
        t.add_row(r.job_id, r.state.value, str(r.step), str(r.spec.steps), r.spec.model, r.spec.env, r.reason)
    _console().print(t)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from opentinker.sdk.client import SyncClient

    c = SyncClient(_nats_url(args))
    try:
        reply = c.job(args.job_id).cancel()
    finally:
        c.close()
    print(f"{args.job_id}: {'cancelled' if reply.ok else reply.error}")
    return 0 if reply.ok else 1


def cmd_endpoint(args: argparse.Namespace) -> int:
    """Submit an inference job and print its OpenAI-compatible URL and bearer token."""
    from opentinker.sdk.client import SyncClient

    c = SyncClient(_nats_url(args))
    try:
        ep = c.submit_inference_job(model=args.model, policy_of=args.job or "", engine=args.engine)
    finally:
        c.close()
    print(f"job      {ep.id}  (opentinker cancel {ep.id} to stop serving)")
    print(f"base_url {ep.url}")
    print(f"model    {ep.model}")
    print(f"api_key  {ep.token}  (shown once)")
    return 0


def tail_record(subject: str, headers: dict[str, str] | None, data: bytes, short: bool) -> dict[str, Any]:
    """One bus message as plain data: its subject, schema (the `Ot-Schema` header) and
    the decoded message, or the reason it does not decode. `short` cuts lists (token
    ids, logprobs) to their first 8 items."""
    import msgspec

    from opentinker.schemas import decode, schema_by_name
    from opentinker.schemas import subjects as S

    name = (headers or {}).get(S.H_SCHEMA, "")
    kind = schema_by_name(name) if name else None
    out: dict[str, Any] = {"subject": subject, "schema": name or None}
    if kind is None:
        out["error"] = f"no schema {name!r}" if name else "no Ot-Schema header"
        out["bytes"] = len(data)
        return out
    try:
        value = msgspec.to_builtins(decode(data, kind))
    except msgspec.MsgspecError as e:
        out["error"] = f"does not decode as {name}: {e}"
        return out
    out["data"] = _shorten(value) if short else value
    return out


def _shorten(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _shorten(x) for k, x in v.items()}
    if isinstance(v, list):
        head = [_shorten(x) for x in v[:8]]
        return head + [f"... {len(v) - 8} more"] if len(v) > 8 else head
    return v


def cmd_tail(args: argparse.Namespace) -> int:
    """Print the messages on SUBJECT (wildcards allowed) as JSON lines, decoded by their
    schema header: with --history first what the streams hold, then live ones."""
    import json

    from opentinker.services.core.bus import Bus

    async def run() -> int:
        bus = await Bus.connect(_nats_url(args), "tail")
        printed = 0
        q: asyncio.Queue = asyncio.Queue()
        try:
            sub = await bus.nc.subscribe(args.subject, cb=q.put)
            if args.history:
                for m in await bus.read_raw(args.subject):
                    print(json.dumps(tail_record(m.subject, m.headers, m.data, args.short)), flush=True)
                    printed += 1
                    if args.count and printed >= args.count:
                        return 0
            while not args.count or printed < args.count:
                m = await q.get()
                print(json.dumps(tail_record(m.subject, m.headers, m.data, args.short)), flush=True)
                printed += 1
            await sub.unsubscribe()
        finally:
            await bus.close()
        return 0

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        return 0


def cmd_wandb(args: argparse.Namespace) -> int:
    from opentinker.sdk.client import Client
    from opentinker.sdk.wandb_bridge import WandbBridge

    async def run() -> int:
        async with await Client.connect(_nats_url(args)) as client:
            rec = await WandbBridge(client, _job_arg(args.job_id), project=args.project, mode=args.mode).follow()
        print(f"wandb run {args.job_id}: job {rec.state.value}")
        return 0

    return asyncio.run(run())


def cmd_plot(args: argparse.Namespace) -> int:
    from opentinker.sdk.views import plot

    data_dir = args.data_dir or str(Path(_home()) / "data")
    out = args.out or str(Path(_home()) / "plots" / args.job_id)
    try:
        files = plot(_job_arg(args.job_id), data_dir, out)
    except LookupError as e:
        raise SystemExit(str(e)) from None
    for f in files:
        print(f)
    return 0


def cmd_episodes(args: argparse.Namespace) -> int:
    from opentinker.sdk.views import episodes, print_episodes

    data_dir = args.data_dir or str(Path(_home()) / "data")
    tok = None
    if args.model:
        from transformers import AutoTokenizer

        from opentinker.services.core.models import resolve_model

        tok = AutoTokenizer.from_pretrained(resolve_model(args.model, _home()))
    eps = episodes(_job_arg(args.job_id), args.step, data_dir, args.limit, args.split, tok)
    if not eps:
        raise SystemExit(f"no {args.split} episodes of job {args.job_id} at step {args.step} in {data_dir}")
    print_episodes(eps, _console())
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from opentinker.sdk.client import Client
    from opentinker.sdk.views import watch

    async def run() -> int:
        async with await Client.connect(_nats_url(args)) as client:
            rec = await watch(client, _job_arg(args.job_id), _console())
        return 0 if rec.state.value == "completed" else 1

    return asyncio.run(run())


def _job_arg(job_id: str) -> str:
    """A job id checked as a subject token; exits naming the problem otherwise."""
    from opentinker.schemas.subjects import check_job_id

    try:
        return check_job_id(job_id)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def cmd_query(args: argparse.Namespace) -> int:
    from rich.table import Table

    from opentinker.services.core.logdb import run_query

    from opentinker.services.core.queries import EXAMPLES

    data_dir = args.data_dir or str(Path(_home()) / "data")
    sql = args.sql
    if args.example:
        if not args.job:
            raise SystemExit("--example needs --job JOB")
        sql = EXAMPLES[args.example].format(job=_job_arg(args.job))
    elif not sql:
        raise SystemExit("give SQL, or --example NAME --job JOB")
    cols, rows = run_query(sql, data_dir)
    t = Table(*cols)
    for r in rows:
        t.add_row(*(f"{v:.4f}" if isinstance(v, float) else str(v) for v in r))
    _console().print(t)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """A filtered slice of the log to Parquet or JSONL (for SFT, or to share)."""
    from opentinker.services.core.logdb import export_query

    data_dir = args.data_dir or str(Path(_home()) / "data")
    n = export_query(args.sql, data_dir, args.out)
    print(f"{n} rows -> {args.out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    importlib.import_module(f"opentinker.services.{args.name}.service").main(args.rest)
    return 0


def cmd_envhost(args: argparse.Namespace) -> int:
    from opentinker.services.envhost.service import main

    main(args.rest)
    return 0


def cmd_serve_model(args: argparse.Namespace) -> int:
    from opentinker.sdk.serve_model import main

    return main(args.rest)


def cmd_data(args: argparse.Namespace) -> int:
    from opentinker.services.envhost.envs.gsm8k import prepare_gsm8k

    out = args.out or str(Path(_home()) / "data" / "gsm8k")
    for split, n in prepare_gsm8k(args.src, out).items():
        print(f"{split}: {n} problems -> {out}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from opentinker.services.core.models import resolve_model

    print(resolve_model(args.model, _home()))
    return 0


def cmd_nats_keys(args: argparse.Namespace) -> int:
    """Make the NATS keys of a deployment (services/core/natsauth.py) in `dir`, once:
    the services' nkey seed, the auth callout's issuer seed and xkey seed, the system
    account's nkey seed (all 0600, secrets) and `auth.conf`, the server config block
    with their public keys and the accounts (include it)."""
    from opentinker.services.core.natsauth import ensure_seed_file, server_auth_config

    out = Path(args.dir)
    svc = ensure_seed_file(out / "service.nk", "user")
    issuer = ensure_seed_file(out / "callout-issuer.nk", "account")
    xkey = ensure_seed_file(out / "callout.xk", "curve")
    system = ensure_seed_file(out / "system.nk", "user")
    (out / "auth.conf").write_text(server_auth_config(svc, issuer, xkey, system))
    print(f"{out / 'service.nk'}: the services' nkey seed (NATS_NKEY), public key {svc}")
    print(f"{out / 'callout-issuer.nk'}: the scheduler's callout issuer seed "
          f"(OPENTINKER_NATS_CALLOUT_ISSUER_FILE), public key {issuer}")
    print(f"{out / 'callout.xk'}: the scheduler's callout xkey seed (OPENTINKER_NATS_CALLOUT_XKEY_FILE), "
          f"public key {xkey}")
    print(f"{out / 'system.nk'}: the scheduler's system-account nkey seed (OPENTINKER_NATS_SYSTEM_NKEY_FILE), "
          f"public key {system}")
    print(f"{out / 'auth.conf'}: include it in the nats-server config")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opentinker", description="Agentic RL for LLMs, as a service.")
    p.add_argument("--nats-url", help="NATS server (default: $NATS_URL, a running `opentinker up`, "
                                      "or nats://127.0.0.1:4222)")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("up", help="start a local NATS server and every service")
    s.add_argument("--without", nargs="*", default=[], choices=SERVICE_NAMES, help="services not to start")
    s.set_defaults(fn=cmd_up)

    s = sub.add_parser("train", help="submit a job from a TOML file and follow it")
    s.add_argument("config")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    s.add_argument("--up", action="store_true", help="start the embedded stack for this job")
    s.add_argument("--job-id", default="")
    s.add_argument("--detach", action="store_true", help="print the job id and return")
    s.add_argument("--wandb", action="store_true", help="also log the job to wandb (offline unless WANDB_API_KEY or WANDB_MODE say otherwise)")
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("infer", help="run a base model, an adapter or a job's policy on an environment")
    s.add_argument("config", nargs="?", help="a job spec TOML: its env, env_args, model and sampling limits")
    s.add_argument("--env", help="environment name (default: the CONFIG's)")
    s.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE", help="an env_args entry")
    s.add_argument("--model", help="base model id or path (default: the CONFIG's, the job's, or SmolLM2)")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--adapter", help="a peft LoRA adapter folder (e.g. <home>/checkpoints/JOB/final)")
    src.add_argument("--job", help="a job id: its latest policy")
    s.add_argument("--episodes", type=int, default=32)
    s.add_argument("--group-size", type=int, default=1, help="episodes per initial state")
    s.add_argument("--split", default="test", help="the env's split (default: test, held out)")
    s.add_argument("--seed", type=int, default=0, help="same seed = same problems")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--max-new-tokens", type=int, default=0, help="per turn (default: the CONFIG's or 256)")
    s.add_argument("--max-turns", type=int, default=0)
    s.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    s.add_argument("--out", help="results folder (default <home>/infer/<run id>)")
    s.add_argument("--run-id", default="")
    s.add_argument("--timeout", type=float, default=1800.0, help="seconds")
    s.add_argument("--up", action="store_true", help="start the embedded stack for this run")
    s.set_defaults(fn=cmd_infer)

    s = sub.add_parser("jobs", help="list jobs")
    s.set_defaults(fn=cmd_jobs)

    s = sub.add_parser("cancel", help="cancel a job")
    s.add_argument("job_id")
    s.set_defaults(fn=cmd_cancel)

    s = sub.add_parser("endpoint", help="serve a model, or a job's policy, as an OpenAI-compatible "
                                        "inference job on a rollout worker")
    s.add_argument("--model", default="smollm2-135m-instruct")
    s.add_argument("--job", help="serve this train job's newest policy")
    s.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    s.set_defaults(fn=cmd_endpoint)

    s = sub.add_parser("export", help="write a query's rows (a slice of the log) to .parquet or .jsonl")
    s.add_argument("sql")
    s.add_argument("--out", required=True, help="a .parquet or .jsonl file")
    s.add_argument("--data-dir", help="the log's root (default <home>/data)")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("tail", help="print a subject's messages as JSON, decoded by their schema")
    s.add_argument("subject", help="e.g. 'ot.job.JOB.>' or 'ot.job.JOB.metrics'")
    s.add_argument("--history", action="store_true", help="first what the streams hold")
    s.add_argument("--count", type=int, default=0, help="stop after this many messages")
    s.add_argument("--short", action="store_true", help="cut long lists (token ids, logprobs) to 8 items")
    s.set_defaults(fn=cmd_tail)

    s = sub.add_parser("watch", help="follow a job live: progress, reward, eval, step time, lag, throughput")
    s.add_argument("job_id")
    s.set_defaults(fn=cmd_watch)

    s = sub.add_parser("wandb", help="log a job (its metrics and rollout figures) to a wandb run named after it")
    s.add_argument("job_id")
    s.add_argument("--project", help="default $WANDB_PROJECT, else opentinker")
    s.add_argument("--mode", choices=["offline", "online", "disabled"],
                   help="default $WANDB_MODE, else online with WANDB_API_KEY, else offline")
    s.set_defaults(fn=cmd_wandb)

    s = sub.add_parser("plot", help="PNG charts of a job (reward, eval, KL, entropy, step time) from the log")
    s.add_argument("job_id")
    s.add_argument("--out", help="folder (default <home>/plots/JOB)")
    s.add_argument("--data-dir", help="log root (default <home>/data)")
    s.set_defaults(fn=cmd_plot)

    s = sub.add_parser("episodes", help="a job's sampled episodes at a step, turn by turn, mask visible")
    s.add_argument("job_id")
    s.add_argument("--step", type=int, default=0)
    s.add_argument("--limit", type=int, default=2)
    s.add_argument("--split", default="train", choices=["train", "eval"])
    s.add_argument("--model", help="decode the tokens with this model's tokenizer (else the logged text)")
    s.add_argument("--data-dir", help="log root (default <home>/data)")
    s.set_defaults(fn=cmd_episodes)

    from opentinker.services.core.queries import EXAMPLES

    s = sub.add_parser("query", help="DuckDB SQL over the trajectory log")
    s.add_argument("sql", nargs="?", default="")
    s.add_argument("--example", choices=sorted(EXAMPLES), help="a documented query (with --job)")
    s.add_argument("--job", help="the job an --example is about")
    s.add_argument("--data-dir", help="log root (default <home>/data)")
    s.set_defaults(fn=cmd_query)

    s = sub.add_parser("serve", help="run one service in the foreground")
    s.add_argument("name", choices=SERVICE_NAMES)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_serve)

    s = sub.add_parser("envhost", help="serve environments (built-in, or --env module:Class)")
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_envhost)

    s = sub.add_parser("serve-model", help="serve a model plus a trained adapter or checkpoint "
                                           "(OpenAI API, vLLM)", add_help=False)
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_serve_model)

    s = sub.add_parser("data", help="prepare a dataset")
    s.add_argument("dataset", choices=["gsm8k"])
    s.add_argument("--src", required=True, help="folder with train.jsonl and test.jsonl")
    s.add_argument("--out", help="output folder (default <home>/data/gsm8k)")
    s.set_defaults(fn=cmd_data)

    s = sub.add_parser("nats-keys", help="make a deployment's NATS keys and auth config (compose/)")
    s.add_argument("dir", help="where to write service.nk, callout-issuer.nk, callout.xk, system.nk and auth.conf")
    s.set_defaults(fn=cmd_nats_keys)

    s = sub.add_parser("models", help="model utilities")
    s.add_argument("action", choices=["prepare"])
    s.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    s.set_defaults(fn=cmd_models)
    return p


# Commands whose arguments all pass through to another parser. argparse's REMAINDER
# drops a leading option (`serve-model --adapter X` -> "unrecognized arguments"), so
# these are split off before parsing.
PASSTHROUGH = ("serve-model", "envhost")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = next((i for i, a in enumerate(argv) if a in PASSTHROUGH and (i == 0 or argv[i - 1] != "--nats-url")),
               None)
    if cut is not None:
        args = build_parser().parse_args(argv[:cut + 1])
        args.rest = argv[cut + 1:]
    else:
        args = build_parser().parse_args(argv)
    if args.cmd in ("serve", "envhost"):
        sys.argv = [f"opentinker {args.cmd}", *args.rest]
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
