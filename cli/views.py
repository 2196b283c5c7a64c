"""What a researcher looks at while a job trains and after: `opentinker watch` (a live
terminal view), `opentinker plot` (PNG charts from the Parquet log) and `opentinker
episodes` (sampled episodes turn by turn, the loss mask visible).

plot and episodes read the log (DuckDB views, services/core/logdb.py); watch follows
the job on the bus through the SDK. matplotlib and the tokenizer are imported only
by the command that needs them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

# chart file -> (title, y label, [(metric key, split, label)])
CHARTS: dict[str, tuple[str, str, list[tuple[str, str, str]]]] = {
    "reward": ("Reward", "mean episode reward", [("reward_mean", "train", "train"), ("reward_mean", "eval", "eval")]),
    "eval": ("Evaluation", "fraction correct", [("correct_frac", "eval", "correct (eval)")]),
    "kl": ("KL", "per token", [("kl", "train", "to the reference (kl_coef > 0)"),
                               ("mismatch_kl", "train", "sampler to learner (the policy that sampled)"),
                               ("approx_kl", "train", "across the step's updates (0 with one update)")]),
    "entropy": ("Policy entropy", "nats per token", [("entropy", "train", "entropy")]),
    "step_time": ("Step time", "seconds", [("step_time_s", "train", "step"), ("train_time_s", "train", "training"),
                                           ("wait_time_s", "train", "waiting for rollouts")]),
}


def metric_series(job_id: str, data_dir: str | Path) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """{(key, split): [(step, value), ...]} of a job, from the log's `metrics` view."""
    from opentinker.services.core.logdb import run_query

    _, rows = run_query(f"SELECT key, split, step, value FROM metrics WHERE job_id = '{job_id}' "
                        "ORDER BY key, split, step", data_dir)
    out: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for key, split, step, value in rows:
        out.setdefault((key, split), []).append((int(step), float(value)))
    return out


def plot(job_id: str, data_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """One PNG per chart in CHARTS that the job has data for (and `agents.png`, each
    seat's reward, for a multi-agent job), plus `overview.png` with them side by side.
    Returns the files written. Raises LookupError when the log holds
    no metrics for the job."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = metric_series(job_id, data_dir)
    if not series:
        raise LookupError(f"no metrics for job {job_id} in {data_dir}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    charts = dict(CHARTS)
    seats = sorted(k.split("/", 1)[1] for k, s in series if k.startswith("reward_mean/") and s == "train")
    if seats:  # a multi-agent job: one reward curve per seat
        charts["agents"] = ("Reward by agent", "mean episode reward",
                            [(f"reward_mean/{a}", "train", a) for a in seats])
    present = {name: spec for name, spec in charts.items() if any((k, s) in series for k, s, _ in spec[2])}
    written = []

    def draw(ax, name: str) -> None:
        title, ylabel, lines = present[name]
        for key, split, label in lines:
            pts = series.get((key, split))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if split == "eval" else None,
                        markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend()

    for name in present:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, name)
        fig.suptitle(job_id, fontsize=9)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 3.6), squeeze=False)
    for ax, name in zip(axes[0], present):
        draw(ax, name)
    fig.suptitle(job_id)
    fig.tight_layout()
    path = out / "overview.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [*written, path]


def episodes(job_id: str, step: int, data_dir: str | Path, limit: int = 2, split: str = "train",
             tokenizer: Any = None) -> list[dict[str, Any]]:
    """Up to `limit` episodes of `job_id` at `step`, each as {episode_id, reward,
    policy_version, segments: [(role, text, mask, n tokens)]}: the prompt (mask 0), then
    per turn the generated action (mask 1) and the observation that followed (mask 0).
    With a tokenizer the text is the tokens as the policy saw them; without, the
    action and observation text the log keeps."""
    from opentinker.services.core.logdb import run_query

    cols, rows = run_query(
        "SELECT episode_id, reward, policy_version, token_ids, loss_mask, prompt_len, turns FROM trajectories "
        f"WHERE job_id = '{job_id}' AND step = {int(step)} AND split = '{split}' ORDER BY episode_id "
        f"LIMIT {int(limit)}", data_dir)
    out = []
    for r in rows:
        e = dict(zip(cols, r))
        ids, mask = list(e["token_ids"]), list(e["loss_mask"])

        def text(a: int, b: int, fallback: str) -> str:
            return tokenizer.decode(ids[a:b]) if tokenizer is not None else fallback

        segs = [("prompt", text(0, e["prompt_len"], f"<{e['prompt_len']} prompt tokens>"), 0, e["prompt_len"])]
        for t in e["turns"]:
            m = set(mask[t["gen_start"]:t["gen_end"]])
            segs.append(("action", text(t["gen_start"], t["gen_end"], t["action"] or ""),
                         1 if m == {1} else (0 if m == {0} else -1), t["gen_end"] - t["gen_start"]))
            if t["obs_end"] > t["gen_end"]:
                m = set(mask[t["gen_end"]:t["obs_end"]])
                segs.append(("observation", text(t["gen_end"], t["obs_end"], t["observation"] or ""),
                             0 if m == {0} else (1 if m == {1} else -1), t["obs_end"] - t["gen_end"]))
        out.append({"episode_id": e["episode_id"], "reward": e["reward"],
                    "policy_version": e["policy_version"], "segments": segs})
    return out


def print_episodes(eps: list[dict[str, Any]], console) -> None:
    """Turn by turn: mask-1 (trained) tokens in green, mask-0 ones dim; a segment whose
    mask is mixed (a bug) in red."""
    from rich.markup import escape

    style = {1: "bold green", 0: "dim", -1: "bold red"}
    for e in eps:
        console.rule(f"{e['episode_id']}  reward {e['reward']:.3f}  policy v{e['policy_version']}")
        for role, text, mask, n in e["segments"]:
            label = {1: "mask 1", 0: "mask 0", -1: "MIXED MASK"}[mask]
            console.print(f"[bold]{role}[/] [{style[mask]}]({label}, {n} tokens)[/]")
            console.print(f"[{style[mask]}]{escape(text)}[/]")


async def watch(client, job_id: str, console, refresh_s: float = 0.5) -> Any:
    """Follow a job live: a progress bar over its steps and a table of the latest step
    (reward, eval, step time, policy lag, throughput). Returns the final record."""
    from rich.console import Group
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    job = client.job(job_id)
    rec = await job.record()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    task = progress.add_task(job_id, total=rec.spec.steps)
    last: dict[str, float] = {}
    evals: dict[str, float] = {}
    best = float("-inf")
    state = rec.state.value

    def table() -> Table:
        t = Table("state", "step", "reward", "best", "eval", "step s", "lag", "tokens/s", box=None)
        t.add_row(state, f"{int(last.get('step', -1)) + 1}/{rec.spec.steps}",
                  f"{last.get('reward_mean', float('nan')):.3f}",
                  f"{best:.3f}" if best > float("-inf") else "-",
                  f"{evals.get('correct_frac', evals.get('reward_mean', float('nan'))):.3f}" if evals else "-",
                  f"{last.get('step_time_s', float('nan')):.1f}", f"{last.get('policy_lag_mean', float('nan')):.2f}",
                  f"{last.get('tokens_per_s', float('nan')):.0f}")
        return t

    t0 = time.monotonic()
    with Live(Group(progress, table()), console=console, refresh_per_second=1 / refresh_s) as live:
        async for m in job.metrics():
            if m.split == "eval":
                evals = dict(m.values)
            else:
                last = {**m.values, "step": m.step}
                best = max(best, m.values.get("reward_mean", best))
                progress.update(task, completed=m.step + 1)
            live.update(Group(progress, table()))
        rec = await job.wait(raise_on_failure=False)
        state = rec.state.value
        live.update(Group(progress, table()))
    console.print(f"{job_id} {state} after {time.monotonic() - t0:.0f} s: {rec.reason}")
    return rec
