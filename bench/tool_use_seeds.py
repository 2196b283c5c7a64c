"""Tool use over seeds (issue 31, README "Tool use over seeds"): 3-digit x 2-digit products
that SmolLM2-135M-Instruct cannot do in its head, solved with the sandboxed python tool
of the `code-math` env over several turns; held-out accuracy of the base model, after a
supervised cold start and after GRPO, mean +- sd across seeds.

    .venv/bin/python bench/tool_use_seeds.py [--seeds 0 1 2] [--demos 64] [--demo-turns 2]
        [--out bench/results/tool_use_seeds.json]
    .venv/bin/python bench/tool_use_seeds.py --report [--readme README.md]   # from the file only

Why a cold start: the base model never earns a reward on this task (0 of 32 sampled
episodes, bench/results/multiturn_probe.json), so every GRPO group has equal rewards and
no advantage. As DeepSeek-R1 (arXiv 2501.12948 §2.3.1) and ReTool (arXiv 2504.11536 §2.2)
do, a supervised fine-tuning on demonstrations of the format comes first. The
demonstrations are scripted, rendered by the env's own code, on train-split problems
only: code that prints `a * b`, the sandbox's real output, `#### <product>`. The cold
start is kept minimal (examples/tool_mul_sft.toml: two steps of 16 demonstrations), so
that GRPO has something left to learn; one step left the model writing the product
without a code fence (reward 0). Measured with seed 0 on 2026-11-27: 24 steps make
the cold start alone solve the task (held-out 1.000 at GRPO's step 0, every group's
rewards equal); demonstrating the tool call alone (`--demo-turns 1`, 12 steps) makes the
model answer the tool's output with another call until its runs are spent (reward 0 in
all of GRPO's first 8 steps).

Per seed, in a fresh home under bench/results/tmp/ (the main home's converted model and
compiled ops shared), each part through the services (`opentinker train CONFIG --up`,
the embedded stack: nats-server and every service as its own process):

1. `--demos` demonstrations -> `<home>/tool_demos.jsonl` (the cold start's one or two
   steps of 16 use the first of them);
2. examples/tool_mul_sft.toml (full fine-tuning, `--set sft_data=...`): the cold start;
3. examples/tool_mul_grpo.toml from its final model (`--set model=<checkpoints/<sft
   job>/final>`): GRPO with LoRA, held-out accuracy at step 0 (the cold-start model) and
   after the last step, from the learner's evaluations in the log (sampled at the
   training temperature, pass@1: greedy decoding is right on every held-out problem
   from the cold start on, so it cannot show what GRPO adds);
4. unless `--no-base`, the base model on the same held-out requests (the learner's
   Evaluator, same seed), on the transformers engine in this process (bench/heldout.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "tool_use_seeds.json"
SFT, GRPO = "examples/tool_mul_sft.toml", "examples/tool_mul_grpo.toml"
MARKER = "tool_use_seeds"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from main_job_seeds import load_config as load  # noqa: E402 (bench/ on the path first)


def demonstrations(n: int, seed: int, env_args: dict, turns: int = 2) -> list[dict]:
    """`n` chats of the calculator loop on distinct train-split problems of `env_args`
    (seeds from `seed` * 1e6): system and question as the env opens an episode, one
    python call; with `turns` 2 also the sandbox's real output as the next user message
    and the final answer. Raises AssertionError if the env does not reward the whole
    loop (a drifted prompt), whichever part is kept."""
    from opentinker.services.envhost.envs.code_math import CodeMathGame
    from opentinker.services.envhost.service import initial_state, open_episode, take_step

    rows, seen, k = [], set(), seed * 1_000_000
    while len(rows) < n:
        state = initial_state(CodeMathGame, env_args, k, "train")
        k += 1
        if state["question"] in seen:
            continue
        seen.add(state["question"])
        game, system, user, _ = open_episode(CodeMathGame, env_args, state)
        a, b = re.fullmatch(r"What is (\d+) \* (\d+)\?", user).groups()
        call = f"```python\nprint({a} * {b})\n```"
        shown = take_step(game, call)
        final = f"#### {state['answer']}"
        assert take_step(game, final).reward == 1.0, (user, shown.observation)
        chat = [{"role": "system", "content": system}, {"role": "user", "content": user},
                {"role": "assistant", "content": call}, {"role": "user", "content": shown.observation},
                {"role": "assistant", "content": final}]
        rows.append({"messages": chat[:3] if turns == 1 else chat})
    return rows


def base_heldout(spec: dict) -> float:
    """The base model's mean reward on the learner's evaluation requests of `spec` (its
    eval split, episodes and temperature)."""
    import gc

    import msgspec

    from heldout import evaluate_in_process
    from opentinker.schemas import JobSpec
    from opentinker.services.core.config import Settings
    from opentinker.services.core.models import resolve_model
    from opentinker.services.rollout.engine_hf import HFEngine

    js = msgspec.convert({k: v for k, v in spec.items() if k != "name"}, JobSpec)
    engine = HFEngine(resolve_model(js.model, Settings().home), seed=js.seed)
    stats = evaluate_in_process(engine, js, 0)
    del engine
    gc.collect()
    return round(float(stats["reward_mean"]), 4)


def run_seed(seed: int, n_demos: int, turns: int, base: bool = True) -> dict:
    from faults import fresh_home
    from main_job_seeds import job_record, train_up as train

    home = fresh_home(f"tool-use-s{seed}")
    grpo = load(GRPO, seed=seed)
    demos = home / "tool_demos.jsonl"
    demos.write_text("".join(json.dumps(r) + "\n" for r in demonstrations(n_demos, seed, grpo["env_args"], turns)))
    stamp = time.strftime("%H%M%S")
    sft_job, rl_job = f"tool-sft-s{seed}-{stamp}", f"tool-rl-s{seed}-{stamp}"
    sft_rc, _, sft_wall = train(SFT, home, sft_job, [f"seed={seed}", f"sft_data={demos}"])
    final = home / "checkpoints" / sft_job / "final"
    rl_rc, started, rl_wall = train(GRPO, home, rl_job, [f"seed={seed}", f"model={final}"])
    rec = job_record(rl_job, home / "data", started)
    rec.update(seed=seed, demos=n_demos, demo_turns=turns, sft_rc=sft_rc, sft_wall_s=sft_wall, rc=rl_rc, wall_s=rl_wall,
               base_heldout=base_heldout(grpo) if base else None)
    return rec


def summary(runs: list[dict]) -> dict:
    from main_job_seeds import mean_sd

    keys = ("base_heldout", "heldout_before", "heldout_after", "first5", "last5", "sft_wall_s", "wall_s")
    out = {k: mean_sd([r[k] for r in runs]) for k in keys}
    out["total_s"] = mean_sd([r["sft_wall_s"] + r["wall_s"] for r in runs])
    return out


def probe_base(path: Path = ROOT / "bench" / "results" / "multiturn_probe.json") -> str:
    """What bench/multiturn_probe.py measured of the base model on this task, as a clause."""
    if not path.exists():
        return "."
    c = next((c for c in json.loads(path.read_text())["candidates"] if c["name"] == "tool-mul-3x2"), None)
    if c is None:
        return "."
    won = round(c["sampled"]["reward_mean"] * c["sampled"]["episodes"])
    return f": it solved {won} of {c['sampled']['episodes']} sampled episodes in `bench/results/{path.name}`."


def report(res: dict) -> str:
    """The markdown table of a results file (the README's numbers)."""
    from provenance import commit_label

    from main_job_seeds import fmt

    s = res["summary"]

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    rows = ["| seed | base model | after cold start (SFT) | after GRPO | GRPO train reward, first 5 -> last 5 steps | "
            "SFT + GRPO wall |",
            "|---|---|---|---|---|---|"]
    for r in res["runs"]:
        rows.append(f"| {r['seed']} | {f(r['base_heldout'])} | {f(r['heldout_before'])} | {f(r['heldout_after'])} | "
                    f"{r['first5']:.3f} -> {r['last5']:.3f} | {r['sft_wall_s']:.0f} + {r['wall_s']:.0f} s |")
    rows.append(f"| mean +- sd ({s['heldout_after']['n']} seeds) | {fmt(s['base_heldout'])} | "
                f"{fmt(s['heldout_before'])} | {fmt(s['heldout_after'])} | {fmt(s['first5'])} -> {fmt(s['last5'])} | "
                f"{fmt(s['total_s'], 0)} s |")
    t = res.get("eval_temperature", 0.0)
    measure = "greedy accuracy" if not t else f"accuracy of sampled episodes (temperature {t:g}, pass@1)"
    base = "" if any(r["base_heldout"] is not None for r in res["runs"]) else (
        " The base model was not evaluated in this run (`--no-base`)" + probe_base())
    head = (f"{res['date']}, {commit_label(res)}, {res['machine']}; `{res['command']}` "
            f"(`bench/results/{Path(res['out']).name}`). Held-out: {measure} on the learner's "
            f"{res['eval_episodes']} evaluation episodes of split `test`, products training never shows; "
            f"cold start on scripted train-split demonstrations ({res['runs'][0]['demos']} made, the SFT "
            f"config's steps x sft_batch_size of them used) "
            f"({'the tool call only' if res['runs'][0].get('demo_turns', 2) == 1 else 'call, output and answer'})."
            + base)
    return head + "\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    from main_job_seeds import report_only, run_seeds, seeds_arguments
    from provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    seeds_arguments(ap, OUT)
    ap.add_argument("--demos", type=int, default=64, help="scripted demonstrations for the cold start")
    ap.add_argument("--demo-turns", type=int, choices=(1, 2), default=2,
                    help="1: demonstrate the tool call only; 2: the call, its output and the answer")
    ap.add_argument("--no-base", action="store_true",
                    help="skip the base model's evaluation (bench/results/multiturn_probe.json has it)")
    args = ap.parse_args()
    if report_only(args, report, MARKER):
        return
    grpo = load(GRPO)
    res = {**provenance(), "configs": [SFT, GRPO], "eval_episodes": grpo["eval_episodes"],
           "eval_temperature": grpo["eval_temperature"], "out": Path(args.out).name}
    run_seeds(res, args.seeds, lambda seed: run_seed(seed, args.demos, args.demo_turns, not args.no_base),
              summary, report, args.out, args.append)

if __name__ == "__main__":
    main()
