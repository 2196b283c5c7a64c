"""`opentinker train CONFIG.toml [MORE.toml ...] [--up] [--set KEY=VALUE]`: submit a job,
follow its metrics to the end, and print the first and last steps' mean reward. Several
configs are a pipeline (e.g. SFT then RL, upstream OpenTinker #18): each stage is
submitted once the one before completed, starting from its policy (`init_from`, unless
the config names one), and its steps print under its stage."""

from __future__ import annotations

import argparse
import asyncio
import time

from opentinker.cli.common import load_job_config, run_client
from opentinker.cli.common import console as new_console


async def _submit_with_retry(client, spec: dict, job_id: str, wait_s: float, starting: bool = False):
    """Submit, retrying while no scheduler answers yet, and (`starting`: the stack was
    just started) while its envhost does not serve the job's env yet."""
    import nats

    from opentinker.schemas.job import SpecError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await client.submit(spec, job_id=job_id)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise
        except SpecError as e:
            if not (starting and e.field == "env") or time.monotonic() > deadline:
                raise
        await asyncio.sleep(1.0)


async def _train(args: argparse.Namespace, nats_url: str) -> int:
    from opentinker.sdk.client import Client
    from opentinker.schemas.job import SpecError

    console = new_console()
    if len(args.config) > 1 and (args.detach or args.job_id):
        console.print("[red]refused:[/] --detach and --job-id take one config, not a pipeline")
        return 2
    specs = [load_job_config(path, args.set) for path in args.config]
    client = await Client.connect(nats_url)
    try:
        previous = ""
        for i, spec in enumerate(specs):
            if previous and not spec.get("init_from"):
                spec["init_from"] = previous
            if len(specs) > 1:
                console.print(f"[bold]stage {i + 1}/{len(specs)}[/]: {args.config[i]}"
                              + (f" (from job {spec['init_from']})" if spec.get("init_from") else ""))
            try:
                job = await _submit_with_retry(client, spec, args.job_id, 120 if args.up else 10,
                                               starting=args.up and i == 0)
            except SpecError as e:
                console.print(f"[red]refused:[/] {e}")
                return 2
            console.print(f"job [bold]{job.id}[/] submitted to {nats_url}")
            if args.detach:
                print(job.id)
                return 0
            if await _follow(args, client, job, spec, console) != 0:
                return 1
            previous = job.id
        return 0
    finally:
        await client.close()


async def _follow(args: argparse.Namespace, client, job, spec: dict, console) -> int:
    """Print the job's steps and evaluations until it ends; 0 if it completed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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
                    f" ± {v.get('reward_se', 0):.3f}  correct {v.get('correct_frac', 0):.3f}"
                    f" ± {v.get('correct_se', 0):.3f}  ({v.get('episodes', 0):.0f} episodes, ± = standard error)")
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
                + ("" if "entropy" not in v else  # a step that forwarded no token has none
                   ("" if "kl" not in v else f"  kl {v['kl']:.4f}")  # kl_coef 0: no reference
                   + f"  entropy {v['entropy']:.3f}  clip {v['clip_frac']:.3f}")
                + f"  lag {v.get('policy_lag_mean', 0):.2f}"
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


def cmd_train(args: argparse.Namespace) -> int:
    return run_client(args, _train)


def cmd_upstream(args: argparse.Namespace) -> int:
    from opentinker.client.run_script import main

    return main(args.rest)


def register(sub) -> None:
    s = sub.add_parser("train", help="submit a job from a TOML file and follow it (several: a pipeline)")
    s.add_argument("config", nargs="+", help="job config(s); each after the first starts from the one before")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec field")
    s.add_argument("--up", action="store_true", help="start the embedded stack for this job")
    s.add_argument("--job-id", default="")
    s.add_argument("--detach", action="store_true", help="print the job id and return")
    s.add_argument("--wandb", action="store_true",
                   help="also log the job to wandb (offline unless WANDB_API_KEY or WANDB_MODE say otherwise)")
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("upstream", help="run one of upstream OpenTinker's client scripts unchanged "
                                        "(math_rl.py, math_inference.py, ...): SCRIPT [hydra overrides]")
    s.add_argument("rest", nargs=argparse.REMAINDER)
    s.set_defaults(fn=cmd_upstream)
