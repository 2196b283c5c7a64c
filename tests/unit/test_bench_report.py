"""The pure parts of the end-to-end benchmark (bench/e2e_report.py, bench/e2e_grpo.py's
spec building): moving averages, time to a reward, rates, span parsing and the step
breakdown, the ratio table, the figure. No stack, no model."""

from __future__ import annotations

import importlib
import io
import json
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    """A bench script as a module (bench/ is not a package; e2e_grpo imports e2e_report
    from beside itself)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


R = _load("e2e_report")


def test_moving_average_is_trailing_and_needs_a_full_window():
    assert R.moving_average([0, 1, 2, 3, 4, 5], 3) == [None, None, 1.0, 2.0, 3.0, 4.0]
    assert R.moving_average([1.0], 5) == [None]
    assert R.moving_average([], 5) == []


def test_time_to_threshold_uses_the_five_step_mean():
    times = [10.0 * (i + 1) for i in range(10)]
    # one lucky step is not enough; the mean of steps 5..9 (0-based 4..8) reaches 0.8
    rewards = [0.0, 1.0, 0.0, 0.0, 0.8, 0.8, 0.8, 0.8, 0.8, 0.9]
    assert R.time_to_threshold(times, rewards, 0.8, 5) == 90.0
    assert R.time_to_threshold(times, [0.5] * 10, 0.8, 5) is None
    assert R.time_to_threshold(times[:4], [1.0] * 4, 0.8, 5) is None  # no full window
    assert R.time_to_threshold(times[:5], [1.0] * 5, 0.8, 5) == 50.0
    with pytest.raises(ValueError):
        R.time_to_threshold([1.0], [1.0, 1.0])


def test_steady_rate_leaves_out_the_first_step():
    assert R.steady_rate([30.0, 40.0, 50.0]) == pytest.approx(2 / 20)
    assert R.steady_rate([30.0]) is None
    assert R.steady_rate([]) is None


def test_first_last_and_summarize_run():
    assert R.first_last([0.0] * 5 + [1.0] * 5) == (0.0, 1.0)
    assert R.first_last([0.0, 1.0]) == (0.0, 1.0)  # a short run: halves
    assert all(math.isnan(x) for x in R.first_last([]))
    rewards = [0.1] * 5 + [0.9] * 5
    ends = [5.0 + 2.0 * i for i in range(10)]
    s = R.summarize_run(rewards, ends)
    assert s["steps"] == 10 and s["train_s"] == 23.0
    assert s["steps_per_s"] == pytest.approx(9 / 18)
    assert s["steps_per_s_incl_first"] == pytest.approx(10 / 23)
    assert s[R.ttt_key()] == ends[9]
    assert (s["reward_first5"], s["reward_last5"]) == pytest.approx((0.1, 0.9))
    with pytest.raises(ValueError):
        R.summarize_run([0.1], [])


def test_ratio_table_speedups_and_missing_numbers():
    key = R.ttt_key()
    systems = {"trl": {"steps_per_s": 0.05, key: 400.0},
               "sync": {"steps_per_s": 0.1, key: None},
               "async": {"steps_per_s": 0.15, key: 200.0}}
    t = R.ratio_table(systems)
    assert t["async_vs_trl"]["steps_per_s"] == pytest.approx(3.0)
    assert t["async_vs_trl"][key] == pytest.approx(2.0)  # trl's time / ours: > 1, we are faster
    assert t["sync_vs_trl"][key] is None                 # sync never reached it
    assert t["async_vs_sync"]["steps_per_s"] == pytest.approx(1.5)
    assert R.ratio_table({"trl": systems["trl"], "async": systems["async"]}).keys() == {"async_vs_trl"}
    assert R.ratio_table({"async": systems["async"]}) == {}
    bf16 = R.ratio_table({"async": systems["async"], "async-bf16": {"steps_per_s": 0.18, key: 160.0}})
    assert bf16.keys() == {"async-bf16_vs_async"}
    assert bf16["async-bf16_vs_async"]["steps_per_s"] == pytest.approx(1.2)
    assert bf16["async-bf16_vs_async"][key] == pytest.approx(1.25)


def _seed_run(seed, trl, sync, asyn, commit="abc1234", sets=(), date="2026-11-29 05:00"):
    key = R.ttt_key()
    return {"commit": commit, "dirty": False, "date": date, "sets": [*sets, f"seed={seed}"],
            "systems": {"trl": {key: trl, "steps_per_s": 0.05, "heldout_accuracy": 0.75},
                        "sync": {key: sync, "steps_per_s": 0.1, "heldout_accuracy": 0.875},
                        "async": {key: asyn, "steps_per_s": 0.12, "heldout_accuracy": 1.0}}}


def test_seed_groups_gather_one_configuration_over_seeds():
    runs = {"a0": _seed_run(0, 600.0, 200.0, 150.0), "a1": _seed_run(1, 900.0, 150.0, 180.0),
            "other_set": _seed_run(2, 1.0, 1.0, 1.0, sets=["lr=1e-4"]),
            "other_commit": _seed_run(3, 1.0, 1.0, 1.0, commit="def5678"),
            "no_commit": _seed_run(4, 1.0, 1.0, 1.0, commit=""),
            "no_seed": {**_seed_run(5, 1.0, 1.0, 1.0), "sets": []}}
    assert R.seed_groups(runs) == [["a0", "a1"]]
    assert R.seed_of({"sets": ["x=1", "seed=7"]}) == 7 and R.seed_of({"sets": ["seed=x"]}) is None


def test_seeds_table_gives_each_seed_and_the_mean_and_sd_leaving_out_a_never():
    runs = [_seed_run(0, 600.0, 200.0, 150.0), _seed_run(1, 900.0, 150.0, 180.0), _seed_run(2, None, 160.0, None)]
    text = R.seeds_table(runs)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")]
    assert rows[0][1:4] == ["trl to 0.8 (s)", "sync to 0.8 (s)", "async to 0.8 (s)"]
    assert rows[1][1:6] == ["600", "200", "150", "4.00", "1.33"]   # trl/async, sync/async
    assert rows[2][1:6] == ["900", "150", "180", "5.00", "0.83"]
    assert rows[3][1:6] == ["never", "160", "never", "-", "-"]
    # mean +- sample sd over the seeds with a number, and how many had one
    assert rows[4][2] == "170 +- 26" and rows[4][3] == "165 +- 21 (2 of 3)"
    assert rows[4][4] == "4.50 +- 0.71 (2 of 3)" and rows[4][6] == "1.20 +- 0.00"
    assert "no later than sync in 1 of 3 seeds" in text


def _spec_run(seed, trl, sync, asyn, date, trl_run_s=800.0, cpu="Xeon", **spec):
    run = _seed_run(seed, trl, sync, asyn, date=date)
    run["machine"] = "x86_64 2 cores"
    run["cpu"] = {"model": cpu, "cores_per_socket": 2, "amx": cpu == "Xeon"}
    job = {"model": "m", "lr": 1e-3, "seed": seed, "dynamic_sampling": 0, **spec}
    for name in ("sync", "async"):
        run["systems"][name]["spec"] = job
    if trl is None and trl_run_s is None:
        del run["systems"]["trl"]
    else:
        run["systems"]["trl"]["train_s"] = trl_run_s
    return run


def test_a_group_run_without_trl_is_set_against_trl_runs_of_the_same_trl_job_and_seed():
    """An `--only sync,async` group is compared with TRL's runs of other files made before
    it only where TRL's job is the same (every field TRL reads, the seed, the machine, its
    CPU model and the libraries); a TRL run that never reached 0.8 gives a lower bound at
    its whole training time."""
    old = {f"old{s}": _spec_run(s, t, 300.0, 200.0, "2026-11-29 04:00") for s, t in ((0, 600.0), (1, None))}
    older = {"older0": _spec_run(0, 900.0, 1.0, 1.0, "2026-11-28 04:00"),
             "later0": _spec_run(0, 1.0, 1.0, 1.0, "2026-11-29 08:00")}  # made after the group: not its reference
    other_lr = {"lr0": _spec_run(0, 1.0, 1.0, 1.0, "2026-11-29 06:00", lr=1e-4),
                "lr1": _spec_run(1, 1.0, 1.0, 1.0, "2026-11-29 06:00", lr=1e-4)}
    # the group: sync and async with a field TRL does not read changed
    new = [_spec_run(s, None, 200.0, a, "2026-11-29 07:00", trl_run_s=None, dynamic_sampling=2)
           for s, a in ((0, 150.0), (1, 160.0))]
    pool = {**old, **older, **other_lr, **{f"new{i}": r for i, r in enumerate(new)}}
    assert R.trl_stand_ins(new, pool) == ["old0", "old1"]  # the newest of the same job, per seed
    assert R.trl_stand_ins(new, {**older, **other_lr}) is None  # seed 1 has none
    # the same job on a machine with another CPU (same "x86_64 2 cores") is no stand-in
    on_amd = [_spec_run(s, None, 200.0, a, "2026-11-30 07:00", trl_run_s=None, cpu="EPYC", dynamic_sampling=2)
              for s, a in ((0, 150.0), (1, 160.0))]
    assert R.trl_stand_ins(on_amd, pool) is None
    text = R.against_trl_table(new, [old["old0"], old["old1"]])
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")]
    assert rows[0][1:] == ["trl to 0.8 (s)", "sync to 0.8 (s)", "sync vs trl, time", "async to 0.8 (s)",
                           "async vs trl, time |"]
    assert rows[1][1:5] == ["600", "200", "3.00", "150"] and rows[1][5] == "4.00 |"
    assert rows[2][1:5] == ["never (> 800)", "200", "> 4.00", "160"] and rows[2][5] == "> 5.00 |"
    assert rows[3][3] == "3.00 +- - (1 of 2)"  # one seed has both: no sd
    assert "async vs trl over all 2 seeds, a TRL run that never reached 0.8 counted at its whole training time: " \
           "mean >= 4.50 (min 4.00)." in text


def test_pass1_is_the_mean_over_problems_with_its_binomial_standard_error():
    got = R.pass1_summary({"2+2": [4, 4], "9+1": [1, 4], "0+3": [2, 5]})
    # by hand: p = 1, 0.25, 0.4; mean 0.55; var terms 0, 0.25*0.75/3 = 0.0625, 0.4*0.6/4 = 0.06
    assert got["pass1"] == pytest.approx(0.55)
    assert got["se"] == pytest.approx(math.sqrt(0.0625 + 0.06) / 3)
    assert (got["problems"], got["samples"]) == (3, 13)
    assert R.pass1_summary({"x": [0, 8]})["se"] == 0.0
    for bad in ({}, {"x": [1, 1]}, {"x": [3, 2]}, {"x": [-1, 4]}):
        with pytest.raises(ValueError):
            R.pass1_summary(bad)


def test_ratio_table_compares_sampled_pass1_where_both_have_it():
    key = R.ttt_key()
    a = {"steps_per_s": 0.2, key: 100.0, "heldout_pass1": {"pass1": 0.9, "se": 0.03}}
    t = R.ratio_table({"trl": {"steps_per_s": 0.1, key: 300.0, "heldout_pass1": {"pass1": 0.85, "se": 0.04}},
                       "async": a, "sync": {"steps_per_s": 0.1, key: 150.0}})
    assert t["async_vs_trl"]["heldout_pass1_diff"] == pytest.approx(0.05)
    assert t["async_vs_trl"]["heldout_pass1_diff_se"] == pytest.approx(0.05)  # hypot(0.03, 0.04)
    assert "heldout_pass1_diff" not in t["sync_vs_trl"] and "heldout_pass1_diff" not in t["async_vs_sync"]
    text = R.report_table({"systems": {"async": a}, "ratios": t})
    assert "0.900 (0.030)" in text and "+0.050 (se 0.050)" in text


def test_sampled_pass1_covers_every_distinct_held_out_problem_once():
    H = _load("heldout")
    E = _load("e2e_grpo")
    from opentinker.cli.common import load_job_config
    from opentinker.schemas.job import spec_from_dict
    from opentinker.services.envhost.envs.arith import split_of

    spec = spec_from_dict(E.opentinker_spec(load_job_config(str(E.CONFIG), []), "sync", 2, 8))
    problems = H.distinct_problems(spec)
    test = {(a, b) for a in range(10) for b in range(10) if split_of("add", a, b) == "test"}
    assert {tuple(json.loads(k).values()) for k in problems} == test and len(problems) == len(test)
    assert len(set(problems.values())) == len(test)  # one seed per problem


# a line as services/core/tracing.py's console exporter writes it
LINE = ('{"name": "learner.forward_backward", "context": {"trace_id": "0x5b", "span_id": "0xf0", '
        '"trace_state": "[]"}, "kind": "SpanKind.INTERNAL", "parent_id": "0x33", '
        '"start_time": "2026-11-23T17:22:02.500000Z", "end_time": "2026-11-23T17:22:04.000000Z", '
        '"status": {"status_code": "UNSET"}, "attributes": {"ot.micro_batch": 1}, "events": [], "links": [], '
        '"resource": {"attributes": {"service.name": "opentinker-learner"}, "schema_url": ""}}')


def test_parse_spans_reads_console_exporter_lines_and_skips_the_rest():
    spans = R.parse_spans(["INFO learner: job x step 3", LINE, LINE[:80], "", "{not json"])
    assert len(spans) == 1
    s = spans[0]
    assert s.name == "learner.forward_backward" and s.service == "opentinker-learner"
    assert s.duration == pytest.approx(1.5)
    assert s.attrs == {"ot.micro_batch": 1}


def test_parse_spans_matches_the_real_exporter_format():
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    buf = io.StringIO()
    provider = TracerProvider(resource=Resource.create({"service.name": "opentinker-rollout"}))
    # the same formatter as tracing.setup
    provider.add_span_processor(SimpleSpanProcessor(
        ConsoleSpanExporter(out=buf, formatter=lambda s: s.to_json(indent=None) + "\n")))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("rollout.generate", attributes={"ot.prompts": 32}), \
            tracer.start_as_current_span("rollout.env_step"):
        pass
    provider.shutdown()
    spans = R.parse_spans(buf.getvalue().splitlines())
    assert [s.name for s in spans] == ["rollout.env_step", "rollout.generate"]
    assert spans[1].attrs["ot.prompts"] == 32 and spans[1].service == "opentinker-rollout"
    assert spans[1].start <= spans[0].start <= spans[0].end <= spans[1].end


def test_union_seconds_counts_overlaps_once_and_clips_to_the_window():
    assert R.union_seconds([(0, 2), (1, 3), (5, 6)], 0, 10) == 4
    assert R.union_seconds([(0, 2), (1, 3), (5, 6)], 1.5, 5.5) == pytest.approx(2.0)
    assert R.union_seconds([(0, 1)], 2, 3) == 0
    assert R.union_seconds([], 0, 1) == 0


def sp(name: str, a: float, b: float):
    return R.Span(name, a, b)


def test_step_breakdown_from_spans_metrics_and_the_bus():
    # a window of 2 steps, 10 s each
    spans = [sp("rollout.generate", 100, 103), sp("rollout.generate", 110, 113),
             # 32 concurrent env calls count as their union
             *[sp("rollout.env_step", 103, 103.5) for _ in range(32)], sp("rollout.env_step", 113, 113.5),
             sp("learner.forward_backward", 104, 108), sp("learner.forward_backward", 114, 118),
             sp("learner.optimizer", 108, 108.5), sp("learner.accumulate", 118, 118.5),
             sp("learner.publish_weights", 109, 109.2), sp("rollout.load_policy", 110, 110.3),
             sp("learner.forward_backward", 50, 60)]  # outside the window: another job
    b = R.step_breakdown(spans, 100, 120, 2, {"optimizer_s": 0.7, "wait_time_s": 3.0}, bus_s_per_step=0.05)
    c = b["categories"]
    assert b["mean_step_s"] == 10
    assert c["generation"]["s_per_step"] == pytest.approx(3.0)
    assert c["env"]["s_per_step"] == pytest.approx(0.5)
    assert c["forward_backward"]["s_per_step"] == pytest.approx(4.0)
    assert c["forward_backward"]["share"] == pytest.approx(0.4)
    assert c["optimizer"] == {"s_per_step": 0.7, "source": "metrics:optimizer_s", "share": pytest.approx(0.07)}
    assert c["weight_sync"]["s_per_step"] == pytest.approx((0.2 + 0.3) / 2)
    assert c["bus_serialization"]["s_per_step"] == 0.05
    assert c["learner_wait"]["s_per_step"] == 3.0
    assert c["batching"]["s_per_step"] is None and c["batching"]["source"].startswith("missing")
    assert "learner_train" not in c


def test_step_breakdown_without_bus_measurement_or_steps():
    b = R.step_breakdown([], 0, 0, 0)
    assert b["categories"]["bus_serialization"]["s_per_step"] is None
    assert b["categories"]["weight_sync"]["s_per_step"] is None
    assert all(r["share"] is None for r in b["categories"].values())


def test_pick_step_takes_the_latest_complete_train_step():
    def t(step, ep, purpose="train", error=""):
        return SimpleNamespace(step=step, episode_id=ep, purpose=purpose, error=error)

    trajs = [t(0, "a"), t(0, "b"), t(1, "c"), t(1, "c"), t(1, "d"), t(2, "e"), t(2, "f", error="boom"),
             t(3, "g", purpose="eval"), t(3, "h", purpose="eval")]
    assert [x.episode_id for x in R.pick_step(trajs, 2)] == ["c", "d"]  # the duplicate counted once
    assert R.pick_step(trajs, 3) == []


def test_median_rounds():
    assert R.median_rounds([{"a": 1.0, "b": 5.0}, {"a": 3.0, "b": 1.0}, {"a": 2.0, "b": 2.0}]) == {"a": 2.0, "b": 2.0}
    assert R.median_rounds([]) == {}


def systems_for_figure():
    return {"trl": {"rewards": [0.1, 0.2, 0.5, 0.8, 0.9, 1.0], "step_end_s": [10, 20, 30, 40, 50, 60]},
            "async": {"rewards": [0.1, 0.3, 0.6, 0.9, 0.9, 1.0], "step_end_s": [5, 9, 13, 17, 21, 25]}}


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "e2e.png"
    R.plot(systems_for_figure(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_table_lists_systems_ratios_and_breakdown():
    systems = {k: R.summarize_run(v["rewards"], [float(x) for x in v["step_end_s"]])
               for k, v in systems_for_figure().items()}
    out = {"systems": systems, "ratios": R.ratio_table(systems),
           "step_breakdown": {"async": R.step_breakdown([sp("rollout.generate", 0, 1)], 0, 4, 2)}}
    text = R.report_table(out)
    assert "trl" in text and "async_vs_trl" in text and "generation" in text
    json.dumps(out)  # the results file is plain JSON


def test_opentinker_specs_override_only_staleness_steps_and_evaluation():
    E = _load("e2e_grpo")
    from opentinker.cli.common import load_job_config
    from opentinker.schemas.job import spec_from_dict

    base = load_job_config(str(E.CONFIG), [])
    changed = {"max_staleness", "steps", "eval_every", "eval_episodes", "eval_split", "eval_temperature"}
    for system, staleness in (("sync", 0), ("async", 1)):
        spec = E.opentinker_spec(base, system, 7, 64)
        assert spec["max_staleness"] == staleness and spec["steps"] == 7 and spec["eval_every"] == 7
        assert spec["eval_episodes"] == 64 and spec["eval_temperature"] == 0.0 and spec["eval_split"] == "test"
        assert {k: v for k, v in spec.items() if k not in changed} == {k: v for k, v in base.items()
                                                                       if k not in changed}
        spec_from_dict(spec)  # a valid job
    assert base["max_staleness"] == load_job_config(str(E.CONFIG), [])["max_staleness"]  # not mutated
    # async-bf16: the async spec with the learner in bfloat16 and a float32 sampler
    bf16 = E.opentinker_spec(base, "async-bf16", 7, 64)
    assert bf16 == {**E.opentinker_spec(base, "async", 7, 64), "dtype": "bfloat16", "sampler_dtype": "float32"}
    spec_from_dict(bf16)
    assert E.parse_only(None) == ["trl", "sync", "async"]  # bf16 only when asked for
    assert E.parse_only(["async-bf16,async"]) == ["async", "async-bf16"]
    assert E.parse_only(["async,trl"]) == ["trl", "async"]
    assert E.parse_only(["sync", "async"]) == ["sync", "async"]
    with pytest.raises(SystemExit):
        E.parse_only(["opentinker"])


def test_main_job_seeds_summary_table_and_readme_markers(tmp_path):
    """bench/main_job_seeds.py: mean +- sample sd across seeds, the bar counted only
    within 600 s, and the README's table written between its markers, nothing else."""
    mjs = _load("main_job_seeds")
    runs = [{"seed": s, "first5": 0.1, "last5": l5, "heldout_before": b, "heldout_after": a, "bar_step": st,
             "bar_s": bs, "wall_s": 400.0} for s, l5, b, a, st, bs in
            [(0, 0.8, 0.0, 0.5, 20, 300.0), (1, 0.9, 0.1, 0.9, 30, 700.0), (2, 0.1, 0.2, 0.1, None, None)]]
    s = mjs.summary(runs)
    assert s["heldout_after"]["mean"] == 0.5 and s["heldout_after"]["sd"] == 0.4 and s["heldout_after"]["n"] == 3
    assert s["gain"]["mean"] == round((0.5 + 0.8 - 0.1) / 3, 4) and s["met_bar"] == 1
    assert s["bar_s"]["n"] == 2 and s["bar_s"]["mean"] == 500.0
    res = {"date": "d", "commit": "0123456789", "machine": "m", "command": "c", "out": "x.json",
           "eval_episodes": 32, "runs": runs, "summary": s}
    table = mjs.report(res)
    assert "| 2 | 0.200 | 0.100 | 0.100 -> 0.100 | not reached | 400 s |" in table
    assert "| mean +- sd (3 seeds) | 0.100 +- 0.100 | 0.500 +- 0.400 |" in table and "1 of 3 within 600 s" in table
    readme = tmp_path / "README.md"
    readme.write_text("top\n<!-- main_job_seeds -->\nold\n<!-- /main_job_seeds -->\nbottom\n")
    mjs.write_readme(readme, table)
    assert readme.read_text() == f"top\n<!-- main_job_seeds -->\n{table}<!-- /main_job_seeds -->\nbottom\n"
    (tmp_path / "bare.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        mjs.write_readme(tmp_path / "bare.md", table)
    # another table between its own markers, the first one's untouched
    readme.write_text(f"{readme.read_text()}<!-- tool_use_seeds -->\n<!-- /tool_use_seeds -->\n")
    mjs.write_readme(readme, "t\n", "tool_use_seeds")
    assert readme.read_text().endswith("bottom\n<!-- tool_use_seeds -->\nt\n<!-- /tool_use_seeds -->\n")
    assert f"<!-- main_job_seeds -->\n{table}<!-- /main_job_seeds -->" in readme.read_text()


def test_tool_use_demonstrations_are_rewarded_train_problems_and_the_table_reads_the_file():
    """bench/tool_use_seeds.py: each cold-start demonstration is a distinct train-split
    product, rendered by the env (its system prompt, the sandbox's real output) and
    rewarded by it; the README table is the results file's per-seed numbers."""
    from opentinker.services.envhost.envs.arith import split_of

    tus = _load("tool_use_seeds")
    env_args = {"source": "arith", "digits": 3, "digits_b": 2, "max_tool_calls": 3}
    rows = tus.demonstrations(4, 7, env_args)
    first = tus.demonstrations(4, 7, env_args, turns=1)  # the tool call alone
    assert [r["messages"] for r in first] == [r["messages"][:3] for r in rows]
    questions = [r["messages"][1]["content"] for r in rows]
    assert len(set(questions)) == 4
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["system", "user", "assistant", "user", "assistant"]
        a, b = (int(x) for x in r["messages"][1]["content"][len("What is "):-1].split(" * "))
        assert 100 <= a <= 999 and 10 <= b <= 99 and split_of("mul", a, b) == "train"
        assert r["messages"][3]["content"].strip() == str(a * b)
        assert r["messages"][4]["content"] == f"#### {a * b}"
        assert "up to 3 times" in r["messages"][0]["content"]
    run = {"seed": 0, "demos": 4, "base_heldout": 0.0, "heldout_before": 0.5, "heldout_after": 0.75,
           "first5": 0.4, "last5": 0.8, "sft_wall_s": 100.0, "wall_s": 900.0}
    res = {"date": "d", "commit": "0123456789", "machine": "m", "command": "c", "out": "t.json",
           "eval_episodes": 32, "runs": [run, {**run, "seed": 1, "heldout_after": 0.25}],
           "summary": tus.summary([run, {**run, "seed": 1, "heldout_after": 0.25}])}
    table = tus.report(res)
    assert "| 0 | 0.000 | 0.500 | 0.750 | 0.400 -> 0.800 | 100 + 900 s |" in table
    assert "| mean +- sd (2 seeds) | 0.000 +- 0.000 | 0.500 +- 0.000 | 0.500 +- 0.354 |" in table
    assert "greedy accuracy" in table and "not evaluated" not in table
    res["eval_temperature"] = 1.0
    res["runs"] = [{**r, "base_heldout": None} for r in res["runs"]]
    table = tus.report(res)
    assert "temperature 1, pass@1" in table and "not evaluated in this run" in table and "| 0 | - | 0.500 |" in table


def test_game_demonstrations_are_legal_random_train_games_and_the_table_reads_the_file():
    """bench/game_seeds.py: each cold-start game is a distinct train-split state of the
    gomoku env, X's moves legal (the env took each) and shown with the env's own replies;
    the README table is the results file's per-seed numbers."""
    from opentinker.services.envhost.envs.gomoku import GomokuGame, split_of
    from opentinker.services.envhost.service import initial_state

    gs = _load("game_seeds")
    env_args = {"size": 5, "win_length": 3, "opponent": "random", "max_illegal": 3, "legal_reward": 0.1}
    rows = gs.demonstrations(6, 3, env_args)
    assert len({json.dumps(r["messages"]) for r in rows}) == 6
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
        assert roles[2:] == ["assistant", "user"] * (len(roles[2:]) // 2) + ["assistant"]
        assert r["result"] in ("win", "loss", "draw")
        for move, reply in zip(r["messages"][2::2], r["messages"][3::2]):
            assert reply["content"].startswith(f"You played {move['content']}.")
    states = [initial_state(GomokuGame, env_args, k, "train") for k in range(3_000_000, 3_000_006)]
    assert all(split_of(s) == "train" for s in states)
    run = {"seed": 0, "demos": 64, "base_win": 0.0, "win_before": 0.5, "win_after": 0.75,
           "first5": 0.4, "last5": 0.8, "sft_wall_s": 100.0, "wall_s": 900.0}
    runs = [run, {**run, "seed": 1, "win_after": 0.25}]
    res = {"date": "d", "commit": "0123456789", "machine": "m", "command": "c", "out": "t.json",
           "eval_episodes": 32, "eval_temperature": 1.0, "random_player_win_rate": 0.578, "runs": runs,
           "game": "gomoku", "configs": ["examples/gomoku_sft.toml", "examples/gomoku_vs_random.toml"],
           "summary": gs.summary(runs)}
    table = gs.report(res)
    assert "| 0 | 0.000 | 0.500 | 0.750 | 0.400 -> 0.800 | 100 + 900 s |" in table
    assert "| mean +- sd (2 seeds) | 0.000 +- 0.000 | 0.500 +- 0.000 | 0.500 +- 0.354 |" in table
    assert "sampled games (temperature 1)" in table and "wins 0.58 of 1,000" in table
    assert res["summary"]["gain_over_base"]["mean"] == 0.5
    guess = gs.report({**res, "game": "guess-number", "configs": ["a.toml", "b.toml"]})
    assert "guess-number (b.toml)" in guess and "binary search" in guess and "1,000" not in guess


def test_selfplay_demonstrations_are_each_seats_side_as_the_coordinator_shows_it():
    """bench/selfplay_seeds.py: a game gives one chat per seat, built as the rollout's
    coordinator builds a seat's conversation (white's first message is its opening joined
    with black's first move); every move legal; train-split openings only; the score
    averages the two seats."""
    from opentinker.services.envhost.envs.selfplay import duel_split_of

    sp = _load("selfplay_seeds")
    env_args = {"size": 5, "win_length": 3, "opening": 1, "illegal": "retry", "max_illegal": 3}
    rows = sp.demonstrations(5, 2, env_args)
    assert [r["seat"] for r in rows] == ["black", "white"] * 5
    for black, white in zip(rows[::2], rows[1::2]):
        assert black["result"] == white["result"] in ("black", "white", "draw")
        assert "as X against" in black["messages"][0]["content"] and "as O against" in white["messages"][0]["content"]
        assert white["messages"][1]["content"].startswith("You are O; X moves first.\n\nX played "
                                                          + black["messages"][2]["content"] + ".")
        for m in black["messages"][3::2]:  # what black is told: white's move, then the position
            assert m["role"] == "user" and m["content"].startswith("O played ")
    from opentinker.services.envhost.envs.selfplay import GomokuDuelGame
    from opentinker.services.envhost.service import initial_state

    stones = [initial_state(GomokuDuelGame, env_args, k, "train")["stones"] for k in range(2_000_000, 2_000_010)]
    assert all(duel_split_of(5, 1, s) == "train" for s in stones)
    assert sp.seat_scores({"win_rate/black": 0.5, "win_rate/white": 0.25, "draw_rate/black": 0.25}) == \
        {"black": 0.5, "white": 0.25}
    run = {"seed": 0, "start_vs_start": {"black": 0.5, "white": 0.4}, "trained_vs_start": {"black": 0.8, "white": 0.6},
           "start_score": 0.45, "trained_score": 0.7, "first5": 0.0, "last5": 0.1,
           "wall_s": {"sft": 100.0, "rl": 800.0, "vs-black": 100.0, "vs-white": 100.0}}
    res = {"date": "d", "commit": "0123456789", "machine": "m", "command": "c", "out": "t.json",
           "eval_episodes": 32, "eval_temperature": 1.0, "steps": 10, "runs": [run], "summary": sp.summary([run]),
           "game": "gomoku-duel", "configs": ["a.toml", "b.toml"]}
    table = sp.report(res)
    assert "| 0 | 0.500 / 0.400 | 0.800 / 0.600 | 0.450 -> 0.700 | 0.000 -> 0.100 | 1100 s |" in table
    assert "(gain 0.250)" in table and "black / white" in table and "win rate averaged" in table
    # negotiation: the score is the deal rate, whichever seat the trained policy takes
    assert sp.seat_scores({"result_rate/deal": 0.25, "reward_mean/alice": 0.1}, "negotiation") == \
        {"alice": 0.25, "bob": 0.25}
    deals = sp.report({**res, "game": "negotiation", "runs": [{**run, "start_vs_start": {"alice": 0.2, "bob": 0.2},
                                                               "trained_vs_start": {"alice": 0.5, "bob": 0.4}}]})
    assert "deal rate, alice / bob" in deals and "| 0 | 0.200 / 0.200 | 0.500 / 0.400 |" in deals


def test_guess_number_demonstrations_are_binary_searches_for_train_targets():
    """bench/game_seeds.py --game guess-number: each cold-start game halves the numbers
    still possible after every reply, ends on "Correct!" within the env's guesses, and
    its target is a train-split target."""
    from opentinker.services.envhost.envs.guess_number import split_of

    gs = _load("game_seeds")
    rows = gs.demonstrations(30, 1, {"n": 100, "max_turns": 7}, "guess-number")
    targets = [int(r["messages"][-1]["content"]) for r in rows]
    assert len(set(targets)) == 30 and all(split_of(100, t) == "train" for t in targets)
    for r in rows:
        guesses = [int(m["content"]) for m in r["messages"][2::2]]
        assert len(guesses) <= 7 and guesses[0] == 50
        lo, hi = 1, 100
        for g, reply in zip(guesses, r["messages"][3::2]):
            assert g == (lo + hi) // 2
            lo, hi = (g + 1, hi) if reply["content"].startswith("Higher") else (lo, g - 1)


def test_a_results_record_names_its_commit_and_whether_the_tree_differed(monkeypatch):
    """bench/provenance.py: every seeds script's record starts with it; a record made
    from a working tree with uncommitted changes says so in its table's head."""
    prov = _load("provenance")
    calls = {"rev-parse": "0123456789abcdef", "status": ""}
    monkeypatch.setattr(prov, "git", lambda *a: calls[a[0]])
    rec = prov.provenance([str(prov.ROOT / "bench" / "x.py"), "--seeds", "0"])
    assert rec["commit"] == "0123456789abcdef" and rec["dirty"] is False
    assert rec["command"] == "bench/x.py --seeds 0" and {"machine", "cpu", "python", "date"} <= set(rec)
    if shutil.which("lscpu"):  # the host's topology, apart from the "x86_64 N cores" line
        assert rec["cpu"]["model"] and rec["cpu"]["threads_per_core"] >= 1 and rec["cpu"]["sockets"] >= 1
    calls["status"] = " M services/learner/loss.py"
    assert prov.provenance(["bench/x.py"])["dirty"] is True
    assert prov.commit_label({"commit": "0123456789", "dirty": True}) == "commit 0123456 (uncommitted changes)"
    assert prov.commit_label({"commit": "0123456789"}) == "commit 0123456"
    mixed = {"commit": "bbbbbbbbb", "runs": [{"seed": 0, "commit": "aaaaaaaaa"}, {"seed": 1, "commit": "bbbbbbbbb"},
                                            {"seed": 2, "commit": "bbbbbbbbb"}]}
    assert prov.commit_label(mixed) == "commits aaaaaaa (seed 0), bbbbbbb (seeds 1, 2)"
    for name in ("main_job_seeds", "tool_use_seeds", "game_seeds", "selfplay_seeds"):
        assert "**provenance()" in (prov.ROOT / "bench" / f"{name}.py").read_text(), name


def test_seeds_appended_to_a_results_file_keep_each_runs_commit(tmp_path):
    """main_job_seeds.run_seeds: every seed's record carries the commit it ran at; with
    append, the seeds already in the file stay (stamped with that file's commit), and a
    seed run again replaces its old record."""
    mjs = _load("main_job_seeds")
    out = tmp_path / "r.json"
    printed = []

    def summary(runs):
        return {"n": len(runs)}

    res = {"commit": "aaa", "dirty": False, "command": "first"}
    mjs.run_seeds(res, [0, 1], lambda s: {"seed": s, "x": s}, summary, printed.append, str(out))
    assert [(r["seed"], r["commit"]) for r in json.loads(out.read_text())["runs"]] == [(0, "aaa"), (1, "aaa")]
    res = {"commit": "bbb", "dirty": True, "command": "second"}
    mjs.run_seeds(res, [1, 2], lambda s: {"seed": s, "x": 10 + s}, summary, printed.append, str(out), append=True)
    got = json.loads(out.read_text())
    assert [(r["seed"], r["commit"], r["x"]) for r in got["runs"]] == [(0, "aaa", 0), (1, "bbb", 11), (2, "bbb", 12)]
    assert got["summary"] == {"n": 3} and got["appended"] == [{"command": "first", "commit": "aaa"}]
    assert got["runs"][1]["dirty"] is True and len(printed) == 2


def test_seeds_table_splits_a_time_into_steps_to_the_threshold_where_runs_have_rewards():
    """time to 0.8 = steps to it / steps/s: with each run's per-step rewards the table
    gives each system's steps (the step whose 5-step mean first holds 0.8, counted from
    1), "never" for a run that did not get there, and their mean +- sd."""
    assert R.steps_to_threshold([0.0, 0.8, 0.8, 0.8, 0.8, 0.8, 1.0]) == 6
    assert R.steps_to_threshold([1.0] * 5) == 5 and R.steps_to_threshold([1.0] * 4) is None
    runs = [_seed_run(0, 600.0, 200.0, 150.0), _seed_run(1, 900.0, 150.0, None)]
    for run, (trl, sync, asyn) in zip(runs, [(20, 12, 10), (30, 8, None)]):
        for name, n in (("trl", trl), ("sync", sync), ("async", asyn)):
            run["systems"][name]["rewards"] = [0.0] * (n - 5) + [0.8] * 5 if n else [0.5] * 40
    rows = [line.split(" | ") for line in R.seeds_table(runs).splitlines() if line.startswith("| ")]
    k = rows[0].index("trl steps to 0.8")
    assert rows[0][k:k + 3] == ["trl steps to 0.8", "sync steps to 0.8", "async steps to 0.8"]
    assert rows[1][k:k + 3] == ["20", "12", "10"] and rows[2][k:k + 3] == ["30", "8", "never"]
    assert rows[3][k:k + 3] == ["25 +- 7", "10 +- 3", "10 +- - (1 of 2)"]
    assert R.seeds_table([_seed_run(0, 600.0, 200.0, 150.0)]).count("steps to") == 0  # no rewards: no column


def test_trl_fields_hold_every_spec_field_the_trl_side_reads():
    """TRL_FIELDS decides which earlier TRL runs stand in for a group run without TRL
    (trl_job): a spec field that bench/e2e_grpo.py's run_trl reads but TRL_FIELDS lacks
    would let a TRL run of another job stand in. Read from run_trl's source."""
    import ast

    tree = ast.parse((BENCH / "e2e_grpo.py").read_text())
    run_trl = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run_trl")
    read = {n.attr for n in ast.walk(run_trl)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "spec"}
    assert {"lr", "group_size", "sampling", "seed"} <= read  # the reading itself works
    assert read <= set(R.TRL_FIELDS), read - set(R.TRL_FIELDS)
