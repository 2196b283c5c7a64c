"""The README's main job over seeds: held-out accuracy before and after training, the
10-minute bar, mean +- sd across seeds.

    .venv/bin/python bench/main_job_seeds.py [--seeds 0 1 2] [--config examples/arith_grpo.toml]
        [--out bench/results/main_job_seeds.json] [--set KEY=VALUE ...]
    .venv/bin/python bench/main_job_seeds.py --report [--readme README.md] [--marker NAME]   # from the file only

Per seed, the command `scripts/train.sh` runs (`opentinker train CONFIG --up`, the
embedded stack started for the job: nats-server and every service as its own process,
vLLM rollout, DeepSpeed learner) with `--set seed=N`, in a fresh home under
bench/results/tmp/ that shares the main home's converted model and compiled ops. From
that job's trajectory log (DuckDB over the Parquet files):

- train reward per step (all sampled episodes of split "train") and the mean of the
  first and the last 5 steps;
- the 10-minute bar (issue 31, README "Measured"): the first step whose trailing 5-step
  mean reward is at least the first-5 mean + 0.25, and the wall seconds from the
  command's start to that step's metrics;
- held-out accuracy: the learner's evaluations (split "test", greedy, `eval_episodes`
  problems training never shows) at step 0 (the base model) and after the last step.

Across seeds: mean and sample sd (ddof 1) of each. `--report` prints the markdown table
from the results file, and with `--readme` writes it between the README's
`<!-- main_job_seeds -->` markers, so the README's numbers are this file's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "main_job_seeds.json"
BAR = 0.25  # reward over the first-5 mean, within 10 minutes (600 s)
BAR_S = 600.0
WINDOW = 5
sys.path.insert(0, str(Path(__file__).resolve().parent))


def job_record(job_id: str, data_dir: Path, started: float) -> dict:
    """The job's curve and evaluations from its trajectory log; `started` is the epoch
    second the command started."""
    from opentinker.services.core.logdb import run_query
    from task_probe import job_curve  # the train reward and evaluations by step

    curve = job_curve(job_id, data_dir)
    train, evals = curve["train_reward"], curve["eval_correct"]
    job = job_id.replace("'", "''")
    times = dict(run_query(f"SELECT step, max(time_s) FROM metrics WHERE job_id = '{job}' AND split = 'train' "
                           "GROUP BY step", data_dir)[1])
    rewards = [r for _, r in train]
    first, last = statistics.fmean(rewards[:WINDOW]), statistics.fmean(rewards[-WINDOW:])
    bar_step = bar_s = None
    for i in range(WINDOW - 1, len(rewards)):
        if statistics.fmean(rewards[i - WINDOW + 1:i + 1]) >= first + BAR:
            bar_step = train[i][0]
            if times.get(bar_step) is not None:
                bar_s = round(times[bar_step] - started, 1)
            break
    return {**curve, "first5": round(first, 4), "last5": round(last, 4),
            "heldout_before": evals[0][1] if evals and evals[0][0] == 0 else None,
            "heldout_after": evals[-1][1] if evals and evals[-1][0] == train[-1][0] + 1 else None,
            "bar_step": bar_step, "bar_s": bar_s}


def train_up(config: str, home: Path, job: str, sets: list[str]) -> tuple[int, float, float]:
    """`opentinker train CONFIG --up --job-id JOB --set ...` with OPENTINKER_HOME=`home`:
    (exit code, start epoch s, wall s)."""
    env = dict(os.environ, OPENTINKER_HOME=str(home), DS_ACCELERATOR="cpu")
    cmd = [str(ROOT / ".venv" / "bin" / "opentinker"), "train", config, "--up", "--job-id", job]
    for s in sets:
        cmd += ["--set", s]
    started = time.time()
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    return rc, started, round(time.time() - started, 1)


def run_seed(config: str, seed: int, sets: list[str]) -> dict:
    from faults import fresh_home

    home = fresh_home(f"main-job-s{seed}")
    job = f"main-s{seed}-{time.strftime('%H%M%S')}"
    rc, started, wall = train_up(config, home, job, [f"seed={seed}", *sets])
    rec = job_record(job, home / "data", started)
    rec.update(seed=seed, rc=rc, wall_s=wall)
    return rec


def mean_sd(xs: list[float | None]) -> dict:
    xs = [x for x in xs if x is not None]
    return {"mean": round(statistics.fmean(xs), 4) if xs else None,
            "sd": round(statistics.stdev(xs), 4) if len(xs) > 1 else None, "n": len(xs)}


def summary(runs: list[dict]) -> dict:
    keys = ("first5", "last5", "heldout_before", "heldout_after", "bar_s", "wall_s")
    out = {k: mean_sd([r[k] for r in runs]) for k in keys}
    out["gain"] = mean_sd([r["heldout_after"] - r["heldout_before"] for r in runs
                           if r["heldout_after"] is not None and r["heldout_before"] is not None])
    out["met_bar"] = sum(r["bar_s"] is not None and r["bar_s"] <= BAR_S for r in runs)
    return out


def fmt(ms: dict, digits: int = 3) -> str:
    if ms["mean"] is None:
        return "-"
    sd = "" if ms["sd"] is None else f" +- {ms['sd']:.{digits}f}"
    return f"{ms['mean']:.{digits}f}{sd}"


def report(res: dict) -> str:
    """The markdown table of a results file (the README's numbers)."""
    from provenance import commit_label

    s = res["summary"]
    rows = ["| seed | held-out before | held-out after | train reward, first 5 -> last 5 steps | +0.25 reached | "
            "`opentinker train --up` (stack start included) |",
            "|---|---|---|---|---|---|"]
    for r in res["runs"]:
        bar = f"step {r['bar_step']}, {r['bar_s']:.0f} s" if r["bar_s"] is not None else "not reached"
        rows.append(f"| {r['seed']} | {r['heldout_before']:.3f} | {r['heldout_after']:.3f} | "
                    f"{r['first5']:.3f} -> {r['last5']:.3f} | {bar} | {r['wall_s']:.0f} s |")
    rows.append(f"| mean +- sd ({s['heldout_after']['n']} seeds) | {fmt(s['heldout_before'])} | "
                f"{fmt(s['heldout_after'])} | {fmt(s['first5'])} -> {fmt(s['last5'])} | "
                f"{fmt(s['bar_s'], 0)} s; {s['met_bar']} of {len(res['runs'])} within {BAR_S:.0f} s | "
                f"{fmt(s['wall_s'], 0)} s |")
    head = (f"{res['date']}, {commit_label(res)}, {res['machine']}; `{res['command']}` "
            f"(`bench/results/{Path(res['out']).name}`). Held-out: greedy accuracy on the learner's "
            f"{res['eval_episodes']} evaluation episodes of split `test`, problems training never shows.")
    return head + "\n\n" + "\n".join(rows) + "\n"


def write_readme(readme: Path, text: str, marker: str = "main_job_seeds") -> None:
    """Write `text` between the README's `<!-- marker -->` and `<!-- /marker -->`
    (schemas.options.with_table). Exits naming the markers when they are missing."""
    from opentinker.schemas.options import with_table

    try:
        readme.write_text(with_table(readme.read_text(), text, marker))
    except ValueError as e:
        raise SystemExit(f"{readme}: {e}") from None


def load_config(config: str, **over) -> dict:
    """A job config (TOML, relative to the repository) as plain data, `over` on top."""
    import tomllib

    return {**tomllib.loads((ROOT / config).read_text()), **over}


def seeds_arguments(ap: argparse.ArgumentParser, out: Path) -> None:
    """The options every seeds script shares: --seeds, --out, --report, --readme."""
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default=str(out))
    ap.add_argument("--report", action="store_true", help="print the table of --out; run nothing")
    ap.add_argument("--readme", help="with --report: write the table into this README between its markers")
    ap.add_argument("--append", action="store_true",
                    help="keep the seeds already in --out and add these (each seed's record names its commit)")


def report_only(args: argparse.Namespace, report, marker: str) -> bool:
    """With --report: print `report` of the --out file and, with --readme, write it between
    the README's `marker` markers. True when it did (the script runs nothing then)."""
    if not args.report:
        return False
    text = report(json.loads(Path(args.out).read_text()))
    print(text)
    if args.readme:
        write_readme(Path(args.readme), text, marker)
    return True


def run_seeds(res: dict, seeds: list[int], run_one, summary, report, out: str, append: bool = False) -> None:
    """`run_one(seed)` for each seed into res["runs"], each record stamped with res's
    commit and dirty flag; after each, print the record (its curves left out), update
    res["summary"] and write `out`, so a stopped run keeps the seeds it finished; then
    print the table. With `append`, the runs already in `out` come first (stamped with
    that file's commit where they have none) and res["appended"] lists the earlier
    files' commands."""
    res.setdefault("runs", [])
    if append and Path(out).exists():
        old = json.loads(Path(out).read_text())
        res["runs"] = [{"commit": old.get("commit"), "dirty": old.get("dirty"), **r} for r in old["runs"]
                       if r["seed"] not in seeds] + res["runs"]
        res["appended"] = [*old.get("appended", []), {"command": old.get("command"), "commit": old.get("commit")}]
    for seed in seeds:
        res["runs"].append({"commit": res.get("commit"), "dirty": res.get("dirty"), **run_one(seed)})
        print(json.dumps({k: v for k, v in res["runs"][-1].items() if k not in ("train_reward", "evals")}),
              flush=True)
        res["summary"] = summary(res["runs"])
        Path(out).write_text(json.dumps(res, indent=1) + "\n")
    print(report(res))


def main() -> None:
    from provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    seeds_arguments(ap, OUT)
    ap.add_argument("--config", default="examples/arith_grpo.toml")
    ap.add_argument("--set", action="append", default=[], help="a spec override for every seed's job")
    ap.add_argument("--marker", default="main_job_seeds",
                    help="the README markers' name: <!-- NAME --> ... <!-- /NAME -->")
    args = ap.parse_args()
    if report_only(args, report, args.marker):
        return
    import tomllib

    eval_episodes = tomllib.loads((ROOT / args.config).read_text()).get("eval_episodes")
    for s in args.set:
        if s.startswith("eval_episodes="):
            eval_episodes = int(s.split("=", 1)[1])
    res = {**provenance(), "config": args.config, "sets": args.set, "eval_episodes": eval_episodes,
           "out": Path(args.out).name, "bar": {"reward_over_first5": BAR, "window": WINDOW, "within_s": BAR_S}}
    run_seeds(res, args.seeds, lambda seed: run_seed(args.config, seed, args.set), summary, report, args.out,
              args.append)

if __name__ == "__main__":
    main()
