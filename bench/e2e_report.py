"""The pure parts of bench/e2e_grpo.py: reward curves, rates, time to a reward, span
parsing and the step breakdown, the ratio table, the figure. Standard library only
(matplotlib for `plot`, imported there); tested in tests/unit/test_bench_report.py.

Definitions (every system alike):

- A run is its per-step train rewards and the wall time at the end of each step,
  counted in seconds from the start of training (TRL: `on_train_begin`; OpenTinker:
  the start of step 0, i.e. the learner's first metrics time minus that step's
  `step_time_s`). Model loading, engine start and job placement are startup, reported
  apart.
- steps/s: over the steps after the first, (n - 1) / (end of step n - end of step 1):
  the first step carries the warm-up (and, for OpenTinker, the version-0 evaluation,
  which the job always runs when evaluation is on).
- time to a reward: the end time of the first step at which the trailing mean of the
  last `k` train rewards (full windows only) reaches the threshold; None if never.
- a ratio "A vs B" is a speedup of A over B (> 1: A is faster): steps/s A / steps/s B,
  and time-to-reward B / time-to-reward A; beside it, the difference of sampled held-out
  pass@1, A - B, with its standard error.
- sampled pass@1 over P problems with n_i samples each, c_i correct: the mean over
  problems of p_i = c_i / n_i (Chen et al. 2021, arXiv 2107.03374, at k = 1); its
  standard error for this set of problems is sqrt(sum_i p_i (1 - p_i) / (n_i - 1)) / P,
  the sampling error of each problem's binomial mean.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

THRESHOLD = 0.8
WINDOW = 5

# The step breakdown: category -> the span names (services' tracing.span) that time it.
# Concurrent spans of one category (32 episodes' env calls at once) count once: a
# category's time is the wall time covered by at least one of its spans.
SPAN_CATEGORIES: dict[str, tuple[str, ...]] = {
    "generation": ("rollout.generate",),
    "env": ("rollout.env_init", "rollout.env_reset", "rollout.env_step"),
    "forward_backward": ("learner.forward_backward",),
    "optimizer": ("learner.optimizer", "learner.accumulate"),
    "batching": ("learner.batch",),
    "weights_publish": ("learner.publish_weights",),
    "weights_load": ("rollout.load_policy",),
    # in place, beside the direct bus measurement: the rollout's publish of each
    # trajectory (encode, JetStream ack) and the learner's handling of each (decode, ledger)
    "traj_publish": ("rollout.publish_trajectory",),
    "learner_trajectory": ("learner.trajectory",),
    "learner_step": ("learner.step",),
}
# learner metrics that, when the learner reports them, time a category directly
METRIC_CATEGORIES: dict[str, str] = {"forward_backward": "fwd_bwd_s", "optimizer": "optimizer_s",
                                     "weights_publish": "weights_s"}
# learner metrics reported beside the breakdown: the whole train call, and the wait for rollouts
METRIC_ROWS: dict[str, str] = {"learner_train": "train_time_s", "learner_wait": "wait_time_s"}


def first_last(rewards: Sequence[float], k: int = WINDOW) -> tuple[float, float]:
    """Mean of the first and of the last `k` rewards (k shrinks to half a short run)."""
    if not rewards:
        return math.nan, math.nan
    k = min(k, max(1, len(rewards) // 2))
    return statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])


def moving_average(values: Sequence[float], k: int = WINDOW) -> list[float | None]:
    """Trailing mean of the last `k` values at each index; None before a full window."""
    out: list[float | None] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= k:
            total -= values[i - k]
        out.append(total / k if i >= k - 1 else None)
    return out


def time_to_threshold(times: Sequence[float], values: Sequence[float], threshold: float = THRESHOLD,
                      k: int = WINDOW) -> float | None:
    """`times[i]` of the first i whose trailing k-mean of `values` is >= threshold."""
    if len(times) != len(values):
        raise ValueError(f"{len(times)} times for {len(values)} values")
    for t, m in zip(times, moving_average(values, k)):
        if m is not None and m >= threshold - 1e-12:
            return t
    return None


def steady_rate(step_ends: Sequence[float]) -> float | None:
    """Steps per second after the first step: (n - 1) / (ends[-1] - ends[0])."""
    if len(step_ends) < 2 or step_ends[-1] <= step_ends[0]:
        return None
    return (len(step_ends) - 1) / (step_ends[-1] - step_ends[0])


def summarize_run(rewards: Sequence[float], step_ends: Sequence[float], threshold: float = THRESHOLD,
                  k: int = WINDOW) -> dict[str, Any]:
    """The per-system numbers of one run: rewards per step and the end of each step in
    seconds since the start of training."""
    if len(rewards) != len(step_ends):
        raise ValueError(f"{len(rewards)} rewards for {len(step_ends)} step ends")
    f, last = first_last(rewards, k)
    n = len(rewards)
    train_s = step_ends[-1] if n else 0.0
    return {
        "steps": n,
        "train_s": train_s,
        "steps_per_s": steady_rate(step_ends),
        "steps_per_s_incl_first": n / train_s if train_s > 0 else None,
        f"time_to_{threshold:g}_s": time_to_threshold(step_ends, rewards, threshold, k),
        "reward_first5": f,
        "reward_last5": last,
        "rewards": list(rewards),
        "step_end_s": list(step_ends),
    }


def steps_to_threshold(values: Sequence[float], threshold: float = THRESHOLD, k: int = WINDOW) -> int | None:
    """How many steps had trained when the trailing k-mean of `values` (one reward a step,
    from step 0) first reached `threshold` (time_to_threshold in steps); None: never."""
    return time_to_threshold(range(1, len(values) + 1), values, threshold, k)


def ttt_key(threshold: float = THRESHOLD) -> str:
    return f"time_to_{threshold:g}_s"


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or (isinstance(a, float) and math.isnan(a)):
        return None
    return a / b


def pass1_summary(problems: Mapping[str, Sequence[int]]) -> dict[str, float | int]:
    """pass@1 of {problem: (correct, samples)}: {"pass1", "se", "problems", "samples"}.
    Raises ValueError if a problem has fewer than 2 samples or more correct than samples."""
    if not problems:
        raise ValueError("pass@1 of no problems")
    ps, var = [], 0.0
    for key, (c, n) in problems.items():
        if n < 2 or not 0 <= c <= n:
            raise ValueError(f"problem {key}: {c} correct of {n} samples (needs n >= 2, 0 <= c <= n)")
        p = c / n
        ps.append(p)
        var += p * (1 - p) / (n - 1)
    k = len(ps)
    return {"pass1": statistics.fmean(ps), "se": math.sqrt(var) / k, "problems": k,
            "samples": sum(n for _, n in problems.values())}


def ratio_table(systems: Mapping[str, Mapping[str, Any]], threshold: float = THRESHOLD) -> dict[str, dict]:
    """Speedups of each pair ("async_vs_trl", "sync_vs_trl", "async_vs_sync",
    "async-bf16_vs_async") present:
    steps/s ratio, and time-to-threshold ratio (the other's time / this one's: > 1
    means this one got there first), and where both have it the difference of sampled
    held-out pass@1 (this one's minus the other's) with its standard error. None where a
    number is missing (never reached)."""
    key = ttt_key(threshold)
    out: dict[str, dict] = {}
    for a, b in (("async", "trl"), ("sync", "trl"), ("async", "sync"), ("async-bf16", "async")):
        if a in systems and b in systems:
            sa, sb = systems[a], systems[b]
            out[f"{a}_vs_{b}"] = {"steps_per_s": _div(sa.get("steps_per_s"), sb.get("steps_per_s")),
                                  key: _div(sb.get(key), sa.get(key))}
            pa, pb = sa.get("heldout_pass1"), sb.get("heldout_pass1")
            if pa and pb:
                out[f"{a}_vs_{b}"].update(heldout_pass1_diff=pa["pass1"] - pb["pass1"],
                                          heldout_pass1_diff_se=math.hypot(pa["se"], pb["se"]))
    return out


def seed_of(run: Mapping[str, Any]) -> int | None:
    """The seed a results file ran with (its `--set seed=N`), None without one."""
    for kv in run.get("sets", []):
        key, _, value = str(kv).partition("=")
        if key.strip() == "seed":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def sets_but_seed(run: Mapping[str, Any]) -> list[str]:
    """A results file's `--set`s other than the seed's, in their order."""
    return [str(kv) for kv in run.get("sets", []) if str(kv).partition("=")[0].strip() != "seed"]


def seed_groups(runs: Mapping[str, Mapping[str, Any]]) -> list[list[str]]:
    """The results files that repeat one configuration over seeds: same commit (dirty
    or not; a file without one is left out), same `--set`s but the seed, same systems;
    groups of >= 2 distinct seeds, newest first, each sorted by seed. runs: {name:
    results file}."""
    groups: dict[tuple, list[str]] = {}
    for name, r in runs.items():
        if seed_of(r) is None or "systems" not in r or not r.get("commit"):
            continue
        key = (str(r["commit"])[:7], bool(r.get("dirty")), tuple(sorted(sets_but_seed(r))), tuple(sorted(r["systems"])))
        groups.setdefault(key, []).append(name)
    out = [sorted(g, key=lambda n: seed_of(runs[n])) for g in groups.values()
           if len({seed_of(runs[n]) for n in g}) >= 2]
    return sorted(out, key=lambda g: max(str(runs[n].get("date", "")) for n in g), reverse=True)


def _mean_sd(xs: Sequence[float | None], spec: str) -> str:
    """mean +- sd (sample) of the numbers among xs, with how many of them had one."""
    n = len(xs)
    v = [x for x in xs if x is not None]
    if not v:
        return f"- (0 of {n})"
    sd = statistics.stdev(v) if len(v) > 1 else float("nan")
    return f"{format(statistics.fmean(v), spec)} +- {_fmt(sd, spec)}" + (f" ({len(v)} of {n})" if len(v) < n else "")


def seeds_table(runs: Sequence[Mapping[str, Any]], threshold: float = THRESHOLD) -> str:
    """One configuration over seeds (seed_groups' files) as a markdown table: per seed
    each system's time to the threshold and held-out accuracy, the speedups in time to
    the threshold (the other's time / async's: > 1 async got there first), async's
    steps/s over sync's and, where every run has its rewards, each system's steps to the
    threshold (steps_to_threshold: time = steps / steps/s, so a time ratio splits into
    the two); then the mean +- sample sd over the seeds that have each number ("never":
    the system's 5-step mean never reached it, which leaves that seed's ratio out), and
    how many seeds async reached it no later than sync in."""
    key = ttt_key(threshold)
    names = [s for s in ("trl", "sync", "async", "async-bf16") if any(s in r["systems"] for r in runs)]
    pairs = [(a, b) for a, b in (("async", "trl"), ("async", "sync")) if a in names and b in names]

    def ttt(s):
        return lambda sy: sy.get(s, {}).get(key)

    # (header, the number from a run's systems, its format, the system whose missing
    # number reads "never": it ran and did not reach the threshold)
    cols = [(f"{s} to {threshold:g} (s)", ttt(s), ".0f", s) for s in names]
    cols += [(f"{a} vs {b}, time", lambda sy, a=a, b=b: _div(ttt(b)(sy), ttt(a)(sy)), ".2f", None)
             for a, b in pairs]
    if ("async", "sync") in pairs:
        cols.append(("async/sync steps/s",
                     lambda sy: _div(sy["async"].get("steps_per_s"), sy["sync"].get("steps_per_s")), ".2f", None))
    if all("rewards" in r["systems"][s] for r in runs for s in names if s in r["systems"]):
        cols += [(f"{s} steps to {threshold:g}",
                  lambda sy, s=s: steps_to_threshold(sy[s]["rewards"], threshold) if s in sy else None, ".0f", s)
                 for s in names]
    cols += [(f"held-out {s}", lambda sy, s=s: sy.get(s, {}).get("heldout_accuracy"), ".3f", None) for s in names]
    table = [[get(r["systems"]) for _, get, _, _ in cols] for r in runs]
    lines = ["| seed | " + " | ".join(c[0] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r, row in zip(runs, table):
        cells = ["never" if v is None and ran in r["systems"] else _fmt(v, f) for v, (_, _, f, ran) in zip(row, cols)]
        lines.append(f"| {seed_of(r)} | " + " | ".join(cells) + " |")
    lines.append("| mean +- sd | " + " | ".join(_mean_sd([row[k] for row in table], c[2])
                                                 for k, c in enumerate(cols)) + " |")
    if ("async", "sync") in pairs:
        a, b = names.index("async"), names.index("sync")
        ok = sum(1 for row in table if row[a] is not None and (row[b] is None or row[a] <= row[b]))
        lines.append(f"\nAsync reached {threshold:g} no later than sync in {ok} of {len(runs)} seeds.")
    return "\n".join(lines)


# the job-spec fields bench/e2e_grpo.py's TRL side reads (run_trl: model, problems,
# batch, LoRA, optimizer, sampling, precision; its held-out evaluation): two results files
# whose OpenTinker specs agree on these ran the same TRL job, whatever else differed
TRL_FIELDS = ("model", "env", "env_args", "prompts_per_step", "group_size", "steps", "lr", "kl_coef",
              "clip_range", "max_grad_norm", "weight_decay", "lora_rank", "lora_alpha", "lora_target_modules",
              "dtype", "sampling", "seed", "eval_episodes", "eval_split", "eval_temperature")


TRL_LIBRARIES = ("torch", "transformers", "trl", "peft")


def trl_job(run: Mapping[str, Any]) -> str | None:
    """The TRL job a results file ran, or would have: the machine and its CPU (model,
    AMX: `dtype = "auto"` trains in bfloat16 only with AMX), the libraries TRL's side
    runs on (TRL_LIBRARIES) and TRL_FIELDS of its OpenTinker spec, as JSON (None without
    a spec)."""
    spec = next((s["spec"] for s in run.get("systems", {}).values() if isinstance(s, Mapping) and "spec" in s), None)
    if spec is None:
        return None
    versions = run.get("versions", {})
    cpu = run.get("cpu") or {}
    return json.dumps({"machine": run.get("machine"), "cpu": [cpu.get("model"), cpu.get("amx")],
                       **{v: versions.get(v) for v in TRL_LIBRARIES},
                       **{f: spec.get(f) for f in TRL_FIELDS}}, sort_keys=True)


def trl_stand_ins(runs: Sequence[Mapping[str, Any]], pool: Mapping[str, Mapping[str, Any]]) -> list[str] | None:
    """For runs of one configuration over seeds without TRL (an `--only sync,async`
    group), per run the newest file of `pool` ({name: results file}) made before it
    whose TRL run is of the same TRL job (trl_job: seed included); None unless every
    run has one."""
    jobs = {n: trl_job(p) for n, p in pool.items() if "trl" in p.get("systems", {})}
    out = []
    for r in runs:
        job, date = trl_job(r), str(r.get("date", ""))
        same = [n for n, j in jobs.items() if job and j == job and str(pool[n].get("date", "")) < date]
        if not same:
            return None
        out.append(max(same, key=lambda n: str(pool[n].get("date", ""))))
    return out


def against_trl_table(runs: Sequence[Mapping[str, Any]], trl_runs: Sequence[Mapping[str, Any]],
                      threshold: float = THRESHOLD) -> str:
    """runs (one configuration over seeds, no TRL) against TRL's runs of the same TRL
    job and seeds from other files (trl_stand_ins), as markdown: per seed TRL's and each
    OpenTinker system's time to the threshold and the speedup (TRL's time / the
    system's), the mean +- sample sd of each over the seeds where both reached it, and
    a lower bound over every seed that counts a TRL run that never reached it as its
    whole training time (it would have taken longer)."""
    key = ttt_key(threshold)
    names = [s for s in ("sync", "async") if all(s in r["systems"] for r in runs)]
    lines = [f"| seed | trl to {threshold:g} (s) | " + " | ".join(f"{s} to {threshold:g} (s) | {s} vs trl, time"
                                                          for s in names) + " |",
             "|---" * (2 + 2 * len(names)) + "|"]
    ratios: dict[str, list[float | None]] = {s: [] for s in names}
    bounds: dict[str, list[float | None]] = {s: [] for s in names}
    for r, t in zip(runs, trl_runs):
        trl = t["systems"]["trl"]
        t_trl, t_run = trl.get(key), trl.get("train_s")
        cells = [_fmt(t_trl, ".0f") if t_trl is not None else f"never (> {_fmt(t_run, '.0f')})"]
        for s in names:
            mine = r["systems"][s].get(key)
            ratios[s].append(_div(t_trl, mine))
            bounds[s].append(_div(t_trl if t_trl is not None else t_run, mine))
            cells += [_fmt(mine, ".0f") if mine is not None else "never",
                      _fmt(ratios[s][-1], ".2f") if t_trl is not None or mine is None
                      else f"> {_fmt(bounds[s][-1], '.2f')}"]
        lines.append(f"| {seed_of(r)} | " + " | ".join(cells) + " |")
    lines.append("| mean +- sd | - | " + " | ".join(f"- | {_mean_sd(ratios[s], '.2f')}" for s in names) + " |")
    for s in names:
        v = [b for b in bounds[s] if b is not None]
        if len(v) == len(runs):
            lines.append(f"\n{s} vs trl over all {len(runs)} seeds, a TRL run that never reached {threshold:g} "
                         f"counted at its whole training time: mean >= {statistics.fmean(v):.2f} "
                         f"(min {min(v):.2f}).")
    return "\n".join(lines)


# -- spans ------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # epoch seconds
    end: float
    service: str = ""
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def duration(self) -> float:
        return self.end - self.start


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()  # "...Z": UTC


def parse_spans(lines: Iterable[str]) -> list[Span]:
    """The spans among a service log's lines: the JSON objects OpenTelemetry's console
    exporter writes, one per line (OTEL_TRACES_EXPORTER=console, services/core/tracing.py).
    Other lines (logging, a line cut by a crash) are skipped."""
    out = []
    for line in lines:
        line = line.strip()
        if not line.startswith('{"name"'):
            continue
        try:
            d = json.loads(line)
            out.append(Span(d["name"], _epoch(d["start_time"]), _epoch(d["end_time"]),
                            (d.get("resource") or {}).get("attributes", {}).get("service.name", ""),
                            d.get("attributes") or {}))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def union_seconds(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Wall time within [lo, hi] covered by at least one interval."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def span_breakdown(spans: Sequence[Span], lo: float, hi: float, steps: int,
                   categories: Mapping[str, Sequence[str]] = SPAN_CATEGORIES) -> dict[str, dict]:
    """Per category: seconds per step (union of its spans within [lo, hi], / steps)
    and how many of its spans fell in the window (0: the span does not exist or never
    ran)."""
    out = {}
    for cat, names in categories.items():
        mine = [(s.start, s.end) for s in spans if s.name in names and s.end > lo and s.start < hi]
        out[cat] = {"s_per_step": union_seconds(mine, lo, hi) / max(steps, 1), "spans": len(mine)}
    return out


def step_breakdown(spans: Sequence[Span], lo: float, hi: float, steps: int,
                   metric_means: Mapping[str, float] | None = None,
                   bus_s_per_step: float | None = None) -> dict[str, Any]:
    """One step's time split into generation, env, bus + serialization, forward/backward,
    optimizer and weight sync, over the steady window [lo, hi] holding `steps` steps.

    A category the learner's metrics time (METRIC_CATEGORIES, when present in
    `metric_means`) is taken from them, else from the spans. `bus_s_per_step`: the
    directly measured bus + serialization time of one step's trajectories. Shares are
    of the mean step time; under asynchrony, rollout (generation, env, weights_load)
    overlaps training, so shares may sum past 1.
    """
    step_s = (hi - lo) / max(steps, 1)
    from_spans = span_breakdown(spans, lo, hi, steps)
    rows: dict[str, dict[str, Any]] = {}
    for cat, v in from_spans.items():
        metric = METRIC_CATEGORIES.get(cat)
        if metric and metric_means and metric in metric_means:
            rows[cat] = {"s_per_step": metric_means[metric], "source": f"metrics:{metric}"}
        elif v["spans"]:
            rows[cat] = {"s_per_step": v["s_per_step"], "source": "spans:" + ",".join(SPAN_CATEGORIES[cat])}
        else:
            rows[cat] = {"s_per_step": None, "source": "missing: no " + "/".join(SPAN_CATEGORIES[cat]) + " span"}
    for row, metric in METRIC_ROWS.items():
        if metric_means and metric in metric_means:
            rows[row] = {"s_per_step": metric_means[metric], "source": f"metrics:{metric}"}
    rows["bus_serialization"] = ({"s_per_step": bus_s_per_step, "source": "measured: msgspec + JetStream"}
                                 if bus_s_per_step is not None else {"s_per_step": None, "source": "not measured"})
    ws = [rows[c]["s_per_step"] for c in ("weights_publish", "weights_load")]
    rows["weight_sync"] = {"s_per_step": sum(w for w in ws if w is not None) if any(w is not None for w in ws)
                           else None, "source": "weights_publish + weights_load"}
    for r in rows.values():
        r["share"] = r["s_per_step"] / step_s if r["s_per_step"] is not None and step_s > 0 else None
    return {"mean_step_s": step_s, "steps": steps, "window_s": hi - lo, "categories": rows}


# -- bus measurement --------------------------------------------------------------


def pick_step(trajs: Sequence[Any], episodes: int) -> list[Any]:
    """The trajectories of the latest training step that has exactly `episodes`
    distinct train episodes (first copy of each), or [] if none does."""
    by_step: dict[int, dict[str, Any]] = {}
    for t in trajs:
        if getattr(t, "purpose", "train") != "train" or getattr(t, "error", ""):
            continue
        by_step.setdefault(t.step, {}).setdefault(t.episode_id, t)
    for step in sorted(by_step, reverse=True):
        if len(by_step[step]) == episodes:
            return list(by_step[step].values())
    return []


def median_rounds(rounds: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per key, the median over rounds."""
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]} if rounds else {}


# -- figure -----------------------------------------------------------------------

COLORS = {"trl": "C0", "sync": "C1", "async": "C2", "async-bf16": "C3"}
LABELS = {"trl": "TRL GRPOTrainer", "sync": "OpenTinker sync (max_staleness 0)",
          "async": "OpenTinker async (max_staleness 1)", "async-bf16": "OpenTinker async, bfloat16 learner"}


def plot(systems: Mapping[str, Mapping[str, Any]], path: str, threshold: float = THRESHOLD,
         k: int = WINDOW) -> None:
    """Two panels: train reward (faint: per step; solid: trailing k-step mean) against
    wall seconds since the start of training, and against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, (key, r) in enumerate(systems.items()):
        color = COLORS.get(key, f"C{i + len(COLORS)}")
        rewards = r["rewards"]
        ma = [math.nan if m is None else m for m in moving_average(rewards, k)]
        steps = list(range(1, len(rewards) + 1))
        for ax, x in ((axes[0], r["step_end_s"]), (axes[1], steps)):
            ax.plot(x, rewards, color=color, alpha=0.25, linewidth=1)
            ax.plot(x, ma, color=color, linewidth=2, label=LABELS.get(key, key))
    for ax, xlabel in zip(axes, ("wall seconds since the start of training", "training step")):
        ax.axhline(threshold, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_xlim(left=0)
    axes[0].set_ylim(-0.02, 1.02)
    axes[1].xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel(f"train reward ({k}-step mean solid)")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("GRPO on single-digit addition, SmolLM2-135M-Instruct (examples/arith_grpo.toml)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- console ----------------------------------------------------------------------


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _pass1(p: Mapping[str, Any] | None) -> str:
    return "-" if not p else f"{p['pass1']:.3f} ({p['se']:.3f})"


def report_table(out: Mapping[str, Any], threshold: float = THRESHOLD) -> str:
    """The results file's numbers as text: one row per system, the ratios, and each
    OpenTinker run's step breakdown."""
    key = ttt_key(threshold)
    header = (f"{'system':<8}{'steps':>6}{'startup s':>11}{'steps/s':>9}{'to ' + format(threshold, 'g') + ' s':>9}"
              f"{'first5':>8}{'last5':>7}{'base acc':>10}{'held-out acc':>14}{'pass@1 (se)':>16}")
    lines = [header]
    for name, r in out.get("systems", {}).items():
        lines.append(f"{name:<8}{r.get('steps', 0):>6}{_fmt(r.get('startup_s'), '.1f'):>11}"
                     f"{_fmt(r.get('steps_per_s'), '.4f'):>9}{_fmt(r.get(key), '.1f'):>9}"
                     f"{_fmt(r.get('reward_first5'), '.3f'):>8}{_fmt(r.get('reward_last5'), '.3f'):>7}"
                     f"{_fmt(r.get('base_accuracy'), '.3f'):>10}{_fmt(r.get('heldout_accuracy'), '.3f'):>14}"
                     f"{_pass1(r.get('heldout_pass1')):>16}")
    for pair, v in out.get("ratios", {}).items():
        lines.append(f"{pair}: steps/s x{_fmt(v.get('steps_per_s'), '.2f')}, time to {threshold:g} "
                     f"x{_fmt(v.get(key), '.2f')} (> 1: the first is faster)"
                     + (f", held-out pass@1 {v['heldout_pass1_diff']:+.3f} (se {v['heldout_pass1_diff_se']:.3f})"
                        if "heldout_pass1_diff" in v else ""))
    for name, b in out.get("step_breakdown", {}).items():
        lines.append(f"{name}: mean step {_fmt(b.get('mean_step_s'), '.2f')} s over {b.get('steps')} steps")
        for cat, r in b.get("categories", {}).items():
            lines.append(f"  {cat:<20}{_fmt(r.get('s_per_step'), '.3f'):>8} s  {_fmt(r.get('share'), '.1%'):>7}"
                         f"  {r.get('source', '')}")
    return "\n".join(lines)
