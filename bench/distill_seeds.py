"""On-policy distillation over seeds (issue 34, README "Distillation over seeds"): a
student taught by a trained job's policy against GRPO from scratch, in sampled tokens to
the teacher's held-out accuracy; self-distillation with the answer as privileged
context against the base model; mean +- sd across seeds.

    .venv/bin/python bench/distill_seeds.py [--seeds 0 1 2] [--out bench/results/distill_seeds.json]
    .venv/bin/python bench/distill_seeds.py --report [--readme README.md]   # from the file only

One embedded stack for the whole run (ops.stack.Stack: nats-server and every service as
its own process, vLLM rollout, DeepSpeed learner) in a fresh home under
bench/results/tmp/, the jobs submitted through the SDK (a teacher is a job of the same
scheduler):

1. RL from scratch, per seed: examples/arith_grpo.toml (GRPO, 4 prompts x 8 episodes a
   step, 40 steps) with `seed` and an evaluation every 5 steps. The first seed's job is
   the teacher; its held-out accuracy after its last step is the target.
2. Distillation, per seed: examples/arith_distill.toml (4 prompts x 2 episodes a step,
   the per-token reverse KL to the teacher as the whole advantage), `teacher_job` that
   job.
3. Self-distillation, per seed: examples/arith_self_distill.toml (the same, the teacher
   the model's own initial weights reading the question and then its answer).

Held-out: the learner's evaluations (32 greedy episodes of split "test", problems
training never shows) every 5 steps. Sampled tokens to the target: the policy tokens
of every train episode sampled for the steps before the first evaluation at or above the
target - 0.05 (dropped and replaced groups included; the teacher's scoring is not
sampling and is not counted). Ratio: RL's tokens / the student's, per seed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "distill_seeds.json"
MARKER = "distill_seeds"
CONFIGS = {"rl": "examples/arith_grpo.toml", "distill": "examples/arith_distill.toml",
           "self": "examples/arith_self_distill.toml"}
EVAL_EVERY = 5
WITHIN = 0.05  # the student must reach the teacher's held-out accuracy minus this
sys.path.insert(0, str(Path(__file__).resolve().parent))

from main_job_seeds import load_config as load  # noqa: E402 (bench/ on the path first)


def curve(job_id: str, data_dir: Path) -> dict:
    """The job's held-out accuracy by evaluation and its sampled policy tokens by step,
    from its log: {"evals": [[version, accuracy, episodes]], "tokens": [[step, policy
    tokens sampled for it]], "train_reward": [[step, mean reward]], "teacher_kl": [[step,
    mean reverse KL per policy token to the teacher]] (none for GRPO)}."""
    from opentinker.services.core.logdb import run_query
    from task_probe import job_curve

    c = job_curve(job_id, data_dir)
    job = job_id.replace("'", "''")
    tokens = run_query(f"SELECT step, sum(num_policy_tokens) FROM trajectories WHERE job_id = '{job}' "
                       "AND split = 'train' GROUP BY step ORDER BY step", data_dir)[1]
    kl = run_query(f"SELECT step, avg(value) FROM metrics WHERE job_id = '{job}' AND split = 'train' "
                   "AND key = 'teacher_kl' GROUP BY step ORDER BY step", data_dir)[1]
    return {"evals": c["eval_correct"], "tokens": [[s, int(n)] for s, n in tokens], "train_reward": c["train_reward"],
            "teacher_kl": [[s, round(v, 5)] for s, v in kl]}


def tokens_to(c: dict, target: float) -> tuple[int | None, int | None]:
    """(the first evaluation's version whose accuracy is >= target, the policy tokens
    sampled for the steps before it), or (None, None) when none reached it."""
    for version, acc, _ in c["evals"]:
        if acc >= target - 1e-9:
            return version, sum(n for s, n in c["tokens"] if s < version)
    return None, None


async def run_all(seeds: list[int], prior: dict | None = None, rerun: tuple[str, ...] = (),
                  over: dict | None = None) -> dict:
    """Every job of every seed in a fresh home; with `prior` (an earlier results file of
    this script, whose home bench/results/tmp/distill is still there), only the kinds in
    `rerun`, with `over` on their configs, beside the earlier run's other jobs and teacher."""
    from faults import fresh_home
    from opentinker.ops.stack import Stack
    from opentinker.sdk import Client
    from selfplay_seeds import run_job

    home = ROOT / "bench" / "results" / "tmp" / "distill" if prior else fresh_home("distill")
    os.environ["OPENTINKER_HOME"] = str(home)
    stamp = time.strftime("%H%M%S")
    ids = {(kind, s): f"{kind}-s{s}-{stamp}" for kind in CONFIGS for s in seeds}
    if prior:
        ids.update({(k, s): prior["ids"][f"{k}-s{s}"] for k in CONFIGS for s in seeds if k not in rerun})
    todo = set(rerun) if prior else set(CONFIGS)
    jobs: dict[tuple[str, int], dict] = {}
    stack = Stack(home).start()
    client = None
    try:
        client = await Client.connect(stack.nats_url)
        teacher = prior["teacher"] if prior else ids[("rl", seeds[0])]  # trained first
        for s in seeds:  # each seed's jobs in turn
            specs = {"rl": load(CONFIGS["rl"], seed=s, eval_every=EVAL_EVERY),
                     "distill": load(CONFIGS["distill"], seed=s, teacher_job=teacher, **(over or {})),
                     "self": load(CONFIGS["self"], seed=s, **(over or {}))}
            for kind in [k for k in CONFIGS if k in todo]:
                jobs[(kind, s)] = await run_job(client, specs[kind], ids[(kind, s)])
    finally:
        if client is not None:
            await client.close()
        stack.stop()
    curves = {k: curve(ids[k], home / "data") for k in ids}
    return {"teacher": teacher, "ids": {f"{k}-s{s}": v for (k, s), v in ids.items()},
            "states": {f"{k}-s{s}": j["state"] for (k, s), j in jobs.items()},
            "wall_s": {f"{k}-s{s}": j["wall_s"] for (k, s), j in jobs.items()},
            "curves": {f"{k}-s{s}": c for (k, s), c in curves.items()}}


def per_seed(res: dict, seeds: list[int]) -> list[dict]:
    """One record per seed: tokens to the target by RL and by the student, their ratio,
    held-out before/after of each job."""
    c = res["curves"]
    teacher_acc = c[f"rl-s{seeds[0]}"]["evals"][-1][1]
    target = teacher_acc - WITHIN
    runs = []
    for s in seeds:
        rl, dist, self_ = c[f"rl-s{s}"], c[f"distill-s{s}"], c[f"self-s{s}"]
        v_rl, t_rl = tokens_to(rl, target)
        v_d, t_d = tokens_to(dist, target)
        runs.append({
            "seed": s, "teacher_acc": teacher_acc, "target": round(target, 4),
            "rl_version": v_rl, "rl_tokens": t_rl, "distill_version": v_d, "distill_tokens": t_d,
            # RL not at the target after its last step: its tokens so far bound the ratio from below
            "rl_total_tokens": sum(n for _, n in rl["tokens"]),
            "ratio": round(t_rl / t_d, 3) if t_rl and t_d else None,
            "ratio_at_least": round(sum(n for _, n in rl["tokens"]) / t_d, 3) if t_d and not t_rl else None,
            "rl_before": rl["evals"][0][1], "rl_after": rl["evals"][-1][1],
            "distill_before": dist["evals"][0][1], "distill_after": dist["evals"][-1][1],
            "distill_best": max(a for _, a, _ in dist["evals"]),
            "self_before": self_["evals"][0][1], "self_after": self_["evals"][-1][1],
            "self_gain": round(self_["evals"][-1][1] - self_["evals"][0][1], 4),
        })
    return runs


def summary(runs: list[dict]) -> dict:
    from main_job_seeds import mean_sd

    keys = ("ratio", "rl_tokens", "distill_tokens", "rl_after", "distill_after", "distill_best", "self_before",
            "self_after", "self_gain")
    out = {k: mean_sd([r[k] for r in runs]) for k in keys}
    out["reached"] = {"rl": sum(r["rl_tokens"] is not None for r in runs),
                      "distill": sum(r["distill_tokens"] is not None for r in runs), "of": len(runs)}
    return out


def report(res: dict) -> str:
    """The markdown table of a results file (the README's numbers)."""
    from main_job_seeds import fmt
    from provenance import commit_label

    s = res["summary"]

    def f(x, d=3):
        return "-" if x is None else f"{x:.{d}f}" if isinstance(x, float) else f"{x}"

    def tok(v, t, total=None):
        if t is None:
            return f"not reached ({total:,} sampled)" if total else "not reached"
        return f"{t:,} (after {v} steps)"

    def ratio(r):
        return f"{r['ratio']:.2f}" if r["ratio"] else f">= {r['ratio_at_least']:.2f}" if r["ratio_at_least"] else "-"

    rows = ["| seed | RL from scratch: tokens to target | distillation: tokens to target | ratio | "
            "held-out after: RL / distillation | self-distillation held-out: base -> after |",
            "|---|---|---|---|---|---|"]
    for r in res["runs"]:
        rows.append(f"| {r['seed']} | {tok(r['rl_version'], r['rl_tokens'], r['rl_total_tokens'])} | "
                    f"{tok(r['distill_version'], r['distill_tokens'])} | {ratio(r)} | "
                    f"{f(r['rl_after'])} / {f(r['distill_after'])} | {f(r['self_before'])} -> {f(r['self_after'])} |")
    rows.append(f"| mean +- sd ({len(res['runs'])} seeds) | {fmt(s['rl_tokens'], 0)} | {fmt(s['distill_tokens'], 0)} "
                f"| {fmt(s['ratio'], 2)} ({s['ratio']['n']} seeds both reached) | "
                f"{fmt(s['rl_after'])} / {fmt(s['distill_after'])} | "
                f"{fmt(s['self_before'])} -> {fmt(s['self_after'])} (gain {fmt(s['self_gain'])}) |")
    r0 = res["runs"][0]
    head = (f"{res['date']}, {commit_label(res)}, {res['machine']}; `{res['command']}` "
            f"(`bench/results/{Path(res['out']).name}`). Teacher: the GRPO job of seed {res['seeds'][0]} "
            f"(held-out {r0['teacher_acc']:.3f}); target: {r0['target']:.3f} (the teacher's - {WITHIN}). "
            f"Held-out: 32 greedy episodes of split `test` every {EVAL_EVERY} steps. Tokens: the policy "
            "tokens sampled for the steps before the first evaluation at or above the target. RL: "
            f"`{CONFIGS['rl']}` (32 episodes a step); distillation: `{CONFIGS['distill']}` (8 a step, the "
            f"reverse KL to the teacher alone); self-distillation: `{CONFIGS['self']}` (the initial weights "
            "reading the answer teach).")
    if res.get("overrides"):
        head += " On the distillation configs: " + ", ".join(f"`{k} = {v}`" for k, v in res["overrides"].items()) + "."
    if res.get("rerun_from"):
        head += (f" {', '.join(res['rerun'])} rerun beside the jobs of `{res['rerun_from']}` (the same teacher and "
                 "GRPO runs).")
    return head + "\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    import json

    from main_job_seeds import report_only, seeds_arguments
    from provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    seeds_arguments(ap, OUT)
    ap.add_argument("--rerun-from", help="an earlier results file: rerun only --rerun's kinds beside its other jobs "
                                         "(its home must still be there)")
    ap.add_argument("--rerun", nargs="+", default=["distill"], choices=sorted(CONFIGS))
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE (TOML) on the distillation configs")
    args = ap.parse_args()
    if report_only(args, report, MARKER):
        return
    import tomllib

    over = {k: tomllib.loads(f"v = {v}")["v"] for k, v in (x.split("=", 1) for x in args.set)}
    prior = json.loads(Path(args.rerun_from).read_text()) if args.rerun_from else None
    res = {**provenance(), "seeds": args.seeds, "configs": CONFIGS, "out": Path(args.out).name,
           "eval_every": EVAL_EVERY, "within": WITHIN, "overrides": over,
           **({"rerun_from": Path(args.rerun_from).name, "rerun": args.rerun} if prior else {})}
    res.update(asyncio.run(run_all(args.seeds, prior, tuple(args.rerun), over)))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")  # the curves, before anything can fail
    res["runs"] = [{"commit": res.get("commit"), "dirty": res.get("dirty"), **r} for r in per_seed(res, args.seeds)]
    res["summary"] = summary(res["runs"])
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(report(res))


if __name__ == "__main__":
    main()
