"""A game against a fixed opponent over seeds (issue 31, README "A game against a fixed
opponent"): guess-number (1..100, 7 guesses, "Higher."/"Lower." after each), or gomoku
(5x5, three in a row, against the env's `random` player) with `--game gomoku`; held-out
win rate of the base model, after a supervised cold start and after GRPO, mean +- sd
across seeds.

    .venv/bin/python bench/game_seeds.py [--game guess-number|gomoku] [--seeds 0 1 2] [--demos 64]
        [--no-base] [--out bench/results/game_seeds.json]
    .venv/bin/python bench/game_seeds.py --report [--readme README.md]   # from the file only

Why a cold start: the base model does not play either game. On guess-number its greedy
reply restates the prompt ("I'm thinking of an integer between 1 and 16...") and the env
reads its first number, so it guesses 1 every turn; GRPO from it moved nothing in 10 to 20
steps (bench/results/guess_number_seed0.json, guess_number_tuned_s0.json). On gomoku it
names no legal cell (all 32 sampled games lost, 24 on an illegal first move,
bench/results/multiturn_probe.json). As for tool use (bench/tool_use_seeds.py;
DeepSeek-R1, arXiv 2501.12948 §2.3.1) a supervised fine-tuning on scripted
demonstrations comes first, rendered and answered by the env's own code, on
train-split problems only:
- guess-number: binary search (guess the middle of the numbers still possible), which
  always wins within 7 guesses; eight SFT steps of 16 games teach the format and roughly
  the search (four left it loose: held-out 0.16, then 0.22 after 8 GRPO steps, against
  the base model's 0.06, seed 0 on 2026-11-28), and GRPO trains the policy's own sampled
  games from there;
- gomoku: X plays a uniformly random empty cell each turn (the rules, no strategy: such
  a player wins 58% of 1,000 games against `random`). Measured on 2026-11-28, one seed:
  a gomoku game is ~800 tokens (the board is in every message), so the cold start took
  12 min and a GRPO step with micro-batches of 8 ran the learner out of memory (20 GB),
  too slow for 3 seeds of 40 min on this 2-core machine; guess-number is the default.

Per seed, in a fresh home under bench/results/tmp/ (the main home's converted model and
compiled ops shared), each part through the services (`opentinker train CONFIG --up`):

1. `--demos` games -> `<home>/game_demos.jsonl` (the cold start uses its steps x
   sft_batch_size first ones);
2. the game's SFT config (full fine-tuning, `--set sft_data=...`): the cold start;
3. the game's GRPO config from its final model (`--set model=<checkpoints/<sft
   job>/final>`): GRPO with LoRA; held-out win rate at step 0 (the cold-start model)
   and after the last step, the learner's evaluations (metrics of split "eval":
   `eval_episodes` games of split "test", sampled at `eval_temperature`);
4. unless `--no-base`, the base model on the same held-out games (the learner's
   Evaluator's requests, same seed), on the transformers engine in this process
   (bench/heldout.py).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "game_seeds.json"
# game -> (SFT config, GRPO config, the eval metric that is its win rate)
GAMES = {"guess-number": ("examples/guess_number_sft.toml", "examples/guess_number_grpo.toml", "correct_frac"),
         "gomoku": ("examples/gomoku_sft.toml", "examples/gomoku_vs_random.toml", "win_rate")}
MARKER = "game_seeds"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from main_job_seeds import load_config as load  # noqa: E402 (bench/ on the path first)


def demonstrations(n: int, seed: int, env_args: dict, game: str = "gomoku") -> list[dict]:
    """`n` chats of whole games of `game`: guess_demonstrations for guess-number; for
    gomoku, games on distinct train-split states of the env with `env_args` (state
    seeds from `seed` * 1e6): the env's system prompt and position,
    then per turn X's move, a uniformly random empty cell (drawn from the state's seed),
    and the env's reply (the opponent's move and the new position) as the next user
    message, up to the move that ends the game. Raises AssertionError if the env refuses
    a move (a drifted parser)."""
    if game == "guess-number":
        return guess_demonstrations(n, seed, env_args)
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


def guess_demonstrations(n: int, seed: int, env_args: dict) -> list[dict]:
    """`n` chats of guess-number with `env_args`, on train-split targets (state seeds from
    `seed` * 1e6; a target repeats only once all train targets are used): the env's
    system prompt and question, then binary search, each guess the middle of the numbers
    still possible (lower middle), each followed by the env's reply, up to "Correct!".
    Raises AssertionError unless the env rewards the game (a drifted prompt or parser)."""
    from opentinker.services.envhost.envs.guess_number import GuessNumberGame, split_of
    from opentinker.services.envhost.service import initial_state, open_episode, take_step

    size = env_args.get("n", 16)
    train = sum(split_of(size, t) == "train" for t in range(1, size + 1))
    rows, seen, k = [], set(), seed * 1_000_000
    while len(rows) < n:
        state = initial_state(GuessNumberGame, env_args, k, "train")
        k += 1
        if state["target"] in seen and len(seen) < train:
            continue
        seen.add(state["target"])
        game, system, user, _ = open_episode(GuessNumberGame, env_args, state)
        chat = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        lo, hi = 1, size
        while True:
            guess = (lo + hi) // 2
            reply = take_step(game, str(guess))
            chat.append({"role": "assistant", "content": str(guess)})
            if reply.done:
                break
            chat.append({"role": "user", "content": reply.observation})
            lo, hi = (guess + 1, hi) if reply.observation.startswith("Higher") else (lo, guess - 1)
        assert reply.reward == 1.0, (state, chat[-2:])
        rows.append({"messages": chat, "result": "win"})
    return rows


def random_player_win_rate(env_args: dict, games: int = 1000) -> float:
    """The win rate of the demonstrations' player (a uniformly random empty cell each
    turn) against the env's opponent, over `games` train-split games."""
    rows = demonstrations(games, 7, env_args)
    return sum(r["result"] == "win" for r in rows) / games


def base_heldout(spec: dict, metric: str) -> float:
    """The base model's held-out win rate (`metric`: win_rate, or correct_frac for a game
    whose episodes report no result) on the learner's evaluation requests of `spec`
    (its eval split, episodes and temperature)."""
    import gc

    import msgspec

    from heldout import run_requests
    from opentinker.schemas import JobSpec
    from opentinker.schemas.stats import episode_stats, game_results
    from opentinker.services.core.config import Settings
    from opentinker.services.core.models import resolve_model
    from opentinker.services.learner.evaluation import Evaluator
    from opentinker.services.rollout.engine_hf import HFEngine

    js = msgspec.convert({k: v for k, v in spec.items() if k != "name"}, JobSpec)
    engine = HFEngine(resolve_model(js.model, Settings().home), seed=js.seed)
    groups, _ = run_requests(engine, js, Evaluator("bench-game", js).requests(0), 0)
    del engine
    gc.collect()
    trajs = [t for g in groups for t in g]
    return round({**episode_stats(trajs), **game_results(trajs)}[metric], 4)


def eval_win_rates(job_id: str, data_dir: Path, key: str = "win_rate") -> list[list]:
    """[[policy version, `key`], ...] of the job's evaluations (metrics of split "eval")."""
    from opentinker.services.core.logdb import run_query

    job = job_id.replace("'", "''")
    rows = run_query(f"SELECT step, value FROM metrics WHERE job_id = '{job}' AND split = 'eval' "
                     f"AND key = '{key}' ORDER BY step", data_dir)[1]
    return [[s, round(v, 4)] for s, v in rows]


def run_seed(game: str, seed: int, n_demos: int, base: bool = True) -> dict:
    from faults import fresh_home
    from main_job_seeds import job_record, train_up as train

    sft_config, grpo_config, metric = GAMES[game]
    home = fresh_home(f"game-s{seed}")
    grpo = load(grpo_config, seed=seed)
    demos = home / "game_demos.jsonl"
    demos.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n"
                             for r in demonstrations(n_demos, seed, grpo["env_args"], game)))
    stamp = time.strftime("%H%M%S")
    sft_job, rl_job = f"game-sft-s{seed}-{stamp}", f"game-rl-s{seed}-{stamp}"
    sft_rc, _, sft_wall = train(sft_config, home, sft_job, [f"seed={seed}", f"sft_data={demos}"])
    final = home / "checkpoints" / sft_job / "final"
    rl_rc, started, rl_wall = train(grpo_config, home, rl_job, [f"seed={seed}", f"model={final}"])
    rec = job_record(rl_job, home / "data", started)
    wins = eval_win_rates(rl_job, home / "data", metric)
    last = rec["train_reward"][-1][0] + 1 if rec["train_reward"] else None
    rec.update(seed=seed, demos=n_demos, sft_rc=sft_rc, sft_wall_s=sft_wall, rc=rl_rc, wall_s=rl_wall,
               eval_win_rate=wins,
               win_before=wins[0][1] if wins and wins[0][0] == 0 else None,
               win_after=wins[-1][1] if wins and wins[-1][0] == last else None,
               base_win=base_heldout(grpo, metric) if base else None)
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
    from provenance import commit_label

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
    game = res.get("game", "gomoku")
    if game == "guess-number":
        held = "targets training never sees"
        demos = "binary search"
    else:
        held = "opponent seeds training never plays"
        demos = (f"random legal moves; that player wins {res['random_player_win_rate']:.2f} of 1,000 games "
                 "against `random`")
    head = (f"{res['date']}, {commit_label(res)}, {res['machine']}; `{res['command']}` "
            f"(`bench/results/{Path(res['out']).name}`). {game} ({res['configs'][1]}); held-out: {measure} in "
            f"the learner's {res['eval_episodes']} evaluation games of split `test`, {held}; cold start on "
            f"scripted train-split games of {demos} ({res['runs'][0]['demos']} made, the SFT config's steps x "
            "sft_batch_size of them used).")
    return head + "\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    from main_job_seeds import report_only, run_seeds, seeds_arguments
    from provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    seeds_arguments(ap, OUT)
    ap.add_argument("--game", choices=sorted(GAMES), default="guess-number")
    ap.add_argument("--demos", type=int, default=128, help="scripted games for the cold start")
    ap.add_argument("--no-base", action="store_true", help="skip the base model's evaluation")
    args = ap.parse_args()
    if report_only(args, report, MARKER):
        return
    grpo = load(GAMES[args.game][1])
    res = {**provenance(), "game": args.game, "configs": list(GAMES[args.game][:2]), "metric": GAMES[args.game][2],
           "eval_episodes": grpo["eval_episodes"], "eval_temperature": grpo["eval_temperature"],
           "out": Path(args.out).name}
    if args.game == "gomoku":
        res["random_player_win_rate"] = random_player_win_rate(grpo["env_args"])
    run_seeds(res, args.seeds, lambda seed: run_seed(args.game, seed, args.demos, not args.no_base),
              summary, report, args.out, args.append)

if __name__ == "__main__":
    main()
