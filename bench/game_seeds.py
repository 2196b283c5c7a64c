"""Games over seeds (issue 31, README "Games over seeds"): gomoku on a 5x5 board, three
in a row, against the env's `random` opponent; held-out win rate of the base model,
after a supervised cold start and after GRPO, mean +- sd across seeds.

    .venv/bin/python bench/game_seeds.py [--seeds 0 1 2] [--demos 64] [--no-base]
        [--out bench/results/game_seeds.json]
    .venv/bin/python bench/game_seeds.py --report [--readme README.md]   # from the file only

Why a cold start: the base model names no legal cell (it lost all 32 sampled games in
bench/results/multiturn_probe.json, 24 on an illegal first move), so as for tool use
(bench/tool_use_seeds.py; DeepSeek-R1, arXiv 2501.12948 §2.3.1) a supervised fine-tuning
on demonstrations of the format comes first. The demonstrations show the rules and
nothing more: X plays a uniformly random empty cell every turn (such a player wins 58%
of 1,000 games against `random`, bench/game_seeds.py's `random_player_win_rate`), on
train-split games only, rendered and answered by the env's own code. Making three in a
row, and blocking the opponent's, is left to GRPO.

Per seed, in a fresh home under bench/results/tmp/ (the main home's converted model and
compiled ops shared), each part through the services (`opentinker train CONFIG --up`):

1. `--demos` games -> `<home>/gomoku_demos.jsonl` (the cold start uses its steps x
   sft_batch_size first ones);
2. examples/gomoku_sft.toml (full fine-tuning, `--set sft_data=...`): the cold start;
3. examples/gomoku_vs_random.toml from its final model (`--set model=<checkpoints/<sft
   job>/final>`): GRPO with LoRA; held-out win rate at step 0 (the cold-start model)
   and after the last step, the learner's evaluations (`win_rate` of split "eval" in
   the metrics log: greedy, `eval_episodes` games of split "test");
4. unless `--no-base`, the base model on the same held-out games (the learner's
   Evaluator's requests, same seed), on the transformers engine in this process
   (bench/heldout.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "game_seeds.json"
SFT, GRPO = "examples/gomoku_sft.toml", "examples/gomoku_vs_random.toml"
MARKER = "game_seeds"
sys.path.insert(0, str(Path(__file__).resolve().parent))


def load(config: str, **over) -> dict:
    import tomllib

    return {**tomllib.loads((ROOT / config).read_text()), **over}


def demonstrations(n: int, seed: int, env_args: dict) -> list[dict]:
    """`n` chats of whole games on distinct train-split states of the gomoku env with
    `env_args` (state seeds from `seed` * 1e6): the env's system prompt and position,
    then per turn X's move, a uniformly random empty cell (drawn from the state's seed),
    and the env's reply (the opponent's move and the new position) as the next user
    message, up to the move that ends the game. Raises AssertionError if the env refuses
    a move (a drifted parser)."""
    from opentinker.services.envhost.envs.gomoku import GomokuGame, cell_name, empties
    from opentinker.services.envhost.service import initial_state, open_episode, take_step

    rows, seen, k = [], set(), seed * 1_000_000
    while len(rows) < n:
        state = initial_state(GomokuGame, env_args, k, "train")
        k += 1
        key = json.dumps(state, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        game, system, user, _ = open_episode(GomokuGame, env_args, state)
        rng = random.Random(k)
        chat = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        while True:
            move = cell_name(*rng.choice(empties(game.board)))
            reply = take_step(game, move)
            assert "illegal_reason" not in reply.info, (move, reply.observation)
            chat.append({"role": "assistant", "content": move})
            if reply.done:
                break
            chat.append({"role": "user", "content": reply.observation})
        rows.append({"messages": chat, "result": reply.info["result"]})
    return rows


def random_player_win_rate(env_args: dict, games: int = 1000) -> float:
    """The win rate of the demonstrations' player (a uniformly random empty cell each
    turn) against the env's opponent, over `games` train-split games."""
    rows = demonstrations(games, 7, env_args)
    return sum(r["result"] == "win" for r in rows) / games


def base_heldout(spec: dict) -> float:
    """The base model's held-out win rate on the learner's evaluation requests of `spec`
    (its eval split, episodes and temperature)."""
    import gc

    import msgspec

    from heldout import run_requests
    from opentinker.schemas import JobSpec
    from opentinker.schemas.stats import game_results
    from opentinker.services.core.config import Settings
    from opentinker.services.core.models import resolve_model
    from opentinker.services.learner.evaluation import Evaluator
    from opentinker.services.rollout.engine_hf import HFEngine

    js = msgspec.convert({k: v for k, v in spec.items() if k != "name"}, JobSpec)
    engine = HFEngine(resolve_model(js.model, Settings().home), seed=js.seed)
    groups, _ = run_requests(engine, js, Evaluator("bench-game", js).requests(0), 0)
    del engine
    gc.collect()
    return round(game_results([t for g in groups for t in g])["win_rate"], 4)


def eval_win_rates(job_id: str, data_dir: Path, key: str = "win_rate") -> list[list]:
    """[[policy version, `key`], ...] of the job's evaluations (metrics of split "eval")."""
    from opentinker.services.core.logdb import run_query

    job = job_id.replace("'", "''")
    rows = run_query(f"SELECT step, value FROM metrics WHERE job_id = '{job}' AND split = 'eval' "
                     f"AND key = '{key}' ORDER BY step", data_dir)[1]
    return [[s, round(v, 4)] for s, v in rows]


def run_seed(seed: int, n_demos: int, base: bool = True) -> dict:
    from faults import fresh_home
    from main_job_seeds import job_record, train_up as train

    home = fresh_home(f"game-s{seed}")
    grpo = load(GRPO, seed=seed)
    demos = home / "gomoku_demos.jsonl"
    demos.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n"
                             for r in demonstrations(n_demos, seed, grpo["env_args"])))
    stamp = time.strftime("%H%M%S")
    sft_job, rl_job = f"game-sft-s{seed}-{stamp}", f"game-rl-s{seed}-{stamp}"
    sft_rc, _, sft_wall = train(SFT, home, sft_job, [f"seed={seed}", f"sft_data={demos}"])
    final = home / "checkpoints" / sft_job / "final"
    rl_rc, started, rl_wall = train(GRPO, home, rl_job, [f"seed={seed}", f"model={final}"])
    rec = job_record(rl_job, home / "data", started)
    wins = eval_win_rates(rl_job, home / "data")
    last = rec["train_reward"][-1][0] + 1 if rec["train_reward"] else None
    rec.update(seed=seed, demos=n_demos, sft_rc=sft_rc, sft_wall_s=sft_wall, rc=rl_rc, wall_s=rl_wall,
               eval_win_rate=wins,
               win_before=wins[0][1] if wins and wins[0][0] == 0 else None,
               win_after=wins[-1][1] if wins and wins[-1][0] == last else None,
               base_win=base_heldout(grpo) if base else None)
    return rec


def summary(runs: list[dict]) -> dict:
    from main_job_seeds import mean_sd

    keys = ("base_win", "win_before", "win_after", "first5", "last5", "sft_wall_s", "wall_s")
    out = {k: mean_sd([r[k] for r in runs]) for k in keys}
    out["total_s"] = mean_sd([r["sft_wall_s"] + r["wall_s"] for r in runs])
    out["gain_over_base"] = mean_sd([r["win_after"] - r["base_win"] for r in runs
                                     if r["win_after"] is not None and r["base_win"] is not None])
    return out


def report(res: dict) -> str:
    """The markdown table of a results file (the README's numbers)."""
    from main_job_seeds import fmt

    s = res["summary"]

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    rows = ["| seed | base model | after cold start (SFT) | after GRPO | "
            "GRPO train reward, first 5 -> last 5 steps | SFT + GRPO wall |",
            "|---|---|---|---|---|---|"]
    for r in res["runs"]:
        rows.append(f"| {r['seed']} | {f(r['base_win'])} | {f(r['win_before'])} | {f(r['win_after'])} | "
                    f"{r['first5']:.3f} -> {r['last5']:.3f} | {r['sft_wall_s']:.0f} + {r['wall_s']:.0f} s |")
    rows.append(f"| mean +- sd ({s['win_after']['n']} seeds) | {fmt(s['base_win'])} | {fmt(s['win_before'])} | "
                f"{fmt(s['win_after'])} | {fmt(s['first5'])} -> {fmt(s['last5'])} | {fmt(s['total_s'], 0)} s |")
    t = res.get("eval_temperature", 0.0)
    measure = "greedy win rate" if not t else f"win rate of sampled games (temperature {t:g})"
    head = (f"{res['date']}, commit {res['commit'][:7]}, {res['machine']}; `{res['command']}` "
            f"(`bench/results/{Path(res['out']).name}`). Held-out: {measure} in the learner's "
            f"{res['eval_episodes']} evaluation games of split `test`, opponent seeds training never plays; "
            f"cold start on scripted train-split games of random legal moves ({res['runs'][0]['demos']} made, "
            f"the SFT config's steps x sft_batch_size of them used; that player wins "
            f"{res['random_player_win_rate']:.2f} of 1,000 games against `random`).")
    return head + "\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    from main_job_seeds import write_readme

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--demos", type=int, default=64, help="scripted games for the cold start")
    ap.add_argument("--no-base", action="store_true", help="skip the base model's evaluation")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--report", action="store_true", help="print the table of --out; run nothing")
    ap.add_argument("--readme", help="with --report: write the table into this README between its markers")
    args = ap.parse_args()
    if args.report:
        text = report(json.loads(Path(args.out).read_text()))
        print(text)
        if args.readme:
            write_readme(Path(args.readme), text, MARKER)
        return
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    res = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M"),
           "commit": commit, "command": "bench/game_seeds.py " + " ".join(sys.argv[1:]),
           "configs": [SFT, GRPO], "eval_episodes": load(GRPO)["eval_episodes"],
           "eval_temperature": load(GRPO)["eval_temperature"], "out": Path(args.out).name,
           "random_player_win_rate": random_player_win_rate(load(GRPO)["env_args"]), "runs": []}
    for seed in args.seeds:
        res["runs"].append(run_seed(seed, args.demos, not args.no_base))
        print(json.dumps({k: v for k, v in res["runs"][-1].items() if k != "train_reward"}), flush=True)
        res["summary"] = summary(res["runs"])
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")  # each seed as it lands
    print(report(res))


if __name__ == "__main__":
    main()
