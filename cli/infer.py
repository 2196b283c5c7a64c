"""`opentinker infer [CONFIG.toml] --env E [--adapter DIR | --job JOB]`: run a base
model, an adapter or a job's policy on an environment and print the episode stats."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from opentinker.cli.common import home, load_job_config, parse_value, run_client
from opentinker.cli.common import console as new_console


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
                "sampling": spec.sampling, "agents": spec.agents}
    env_args = dict(base.get("env_args", {}))
    for item in args.env_arg:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--env-arg {item!r}: expected KEY=VALUE")
        env_args[key] = parse_value(raw)
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
                timeout_s=args.timeout, agents=args.agents or base.get("agents", 1))


async def _infer(args: argparse.Namespace, nats_url: str) -> int:
    from rich.table import Table

    from opentinker.sdk.client import Client
    from opentinker.sdk.infer import InferError, infer, new_run_id

    kw = infer_settings(args)
    run_id = args.run_id or new_run_id()
    out_dir = args.out or str(Path(home()) / "infer" / run_id)
    console = new_console()
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
    return run_client(args, _infer)


def register(sub) -> None:
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
    s.add_argument("--agents", type=int, default=0,
                   help="seats of a multi-agent env (default: the CONFIG's, the job's, or 1)")
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

