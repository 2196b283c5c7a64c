"""A user's jobs through the SDK: `jobs`, `cancel JOB`, `endpoint`, `watch JOB`, `wandb JOB`."""

from __future__ import annotations

import argparse
import asyncio

from opentinker.cli.common import console, job_arg, nats_url


def cmd_jobs(args: argparse.Namespace) -> int:
    from rich.table import Table

    from opentinker.sdk.client import SyncClient

    c = SyncClient(nats_url(args))
    try:
        recs = c.jobs()
    finally:
        c.close()
    t = Table("job", "state", "step", "steps", "model", "env", "reason")
    for r in recs:
        t.add_row(r.job_id, r.state.value, str(r.step), str(r.spec.steps), r.spec.model, r.spec.env, r.reason)
    console().print(t)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from opentinker.sdk.client import SyncClient

    c = SyncClient(nats_url(args))
    try:
        reply = c.job(args.job_id).cancel()
    finally:
        c.close()
    print(f"{args.job_id}: {'cancelled' if reply.ok else reply.error}")
    return 0 if reply.ok else 1


def cmd_endpoint(args: argparse.Namespace) -> int:
    """Submit an inference job and print its OpenAI-compatible URL and bearer token."""
    from opentinker.sdk.client import SyncClient

    c = SyncClient(nats_url(args))
    try:
        ep = c.submit_inference_job(model=args.model, policy_of=args.job or "", engine=args.engine)
    finally:
        c.close()
    print(f"job      {ep.id}  (opentinker cancel {ep.id} to stop serving)")
    print(f"base_url {ep.url}")
    print(f"model    {ep.model}")
    print(f"api_key  {ep.token}  (shown once)")
    return 0


def cmd_wandb(args: argparse.Namespace) -> int:
    from opentinker.sdk.client import Client
    from opentinker.sdk.wandb_bridge import WandbBridge

    async def run() -> int:
        async with await Client.connect(nats_url(args)) as client:
            rec = await WandbBridge(client, job_arg(args.job_id), project=args.project, mode=args.mode).follow()
        print(f"wandb run {args.job_id}: job {rec.state.value}")
        return 0

    return asyncio.run(run())


def cmd_watch(args: argparse.Namespace) -> int:
    from opentinker.sdk.client import Client
    from opentinker.cli.views import watch

    async def run() -> int:
        async with await Client.connect(nats_url(args)) as client:
            rec = await watch(client, job_arg(args.job_id), console())
        return 0 if rec.state.value == "completed" else 1

    return asyncio.run(run())


def register(sub) -> None:
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

    s = sub.add_parser("watch", help="follow a job live: progress, reward, eval, step time, lag, throughput")
    s.add_argument("job_id")
    s.set_defaults(fn=cmd_watch)

    s = sub.add_parser("wandb", help="log a job (its metrics and rollout figures) to a wandb run named after it")
    s.add_argument("job_id")
    s.add_argument("--project", help="default $WANDB_PROJECT, else opentinker")
    s.add_argument("--mode", choices=["offline", "online", "disabled"],
                   help="default $WANDB_MODE, else online with WANDB_API_KEY, else offline")
    s.set_defaults(fn=cmd_wandb)

