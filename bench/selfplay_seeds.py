"""Self-play over seeds (issue 31, README "Self-play over seeds"): gomoku-duel on a 5x5
board, three in a row, both seats played by the policy in training; then the trained
policy against the policy it started from, seated by league play (`opponents`), against
that starting policy against itself; mean +- sd across seeds.

    .venv/bin/python bench/selfplay_seeds.py [--seeds 0 1 2] [--demos 64]
        [--out bench/results/selfplay_seeds.json]
    .venv/bin/python bench/selfplay_seeds.py --report [--readme README.md]   # from the file only

The starting policy is a cold start, as for the game against `random`
(bench/game_seeds.py; DeepSeek-R1, arXiv 2501.12948 §2.3.1), because the base model names
no legal cell: a supervised fine-tuning on scripted train-split games in which both
seats play a uniformly random empty cell, each seat's side of the game one chat, as the
rollout's coordinator shows it to that seat. It shows the rules, not how to win.

Per seed, one embedded stack (ops.stack.Stack: nats-server and every service as its own
process) in a fresh home under bench/results/tmp/ (the main home's converted model and
compiled ops shared), the jobs submitted through the SDK:

1. examples/gomoku_duel_sft.toml on `--demos` games (full fine-tuning): the starting
   policy C, a whole model at `<home>/checkpoints/<job>/final`;
2. examples/gomoku_duel_grpo.toml from C (`model` = that folder): self-play GRPO with
   LoRA, S. Its evaluation at step 0 is C against itself;
3. two league evaluations, each a one-step job on C with S's final policy on one seat
   (`opponents = {white = S}`, then `{black = S}`): their evaluations at step 0 are S
   against C, with S on each seat.

Held-out: the learner's evaluations (`eval_episodes` games of split "test": opening
positions training never plays, sampled at `eval_temperature`), `win_rate/<seat>` in the
metrics log. The score of a policy against another is its win rate averaged over the
two seats (black moves first, so one seat alone would mostly measure that advantage);
C against itself scores (1 - draws) / 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "selfplay_seeds.json"
SFT, GRPO = "examples/gomoku_duel_sft.toml", "examples/gomoku_duel_grpo.toml"
MARKER = "selfplay_seeds"
SEATS = ("black", "white")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def demonstrations(n: int, seed: int, env_args: dict) -> list[dict]:
    """`n` games on distinct train-split openings of gomoku-duel with `env_args` (state
    seeds from `seed` * 1e6), both seats playing a uniformly random empty cell; one chat
    per seat and game, as services/rollout/coordinator.py builds a seat's conversation:
    the seat's system prompt, its opening message joined with what it was told before
    its first move, then its moves and, between them, what the env addressed to it
    (joined by blank lines). Returns 2 * `n` rows {"messages", "seat", "result"}.
    Raises AssertionError if the env refuses a move (a drifted parser)."""
    from opentinker.services.envhost.envs.gomoku import cell_name, empties
    from opentinker.services.envhost.envs.selfplay import GomokuDuelGame
    from opentinker.services.envhost.service import initial_state, open_multi_episode, take_phase

    rows, seen, k = [], set(), seed * 1_000_000
    while len(rows) < 2 * n:
        state = initial_state(GomokuDuelGame, env_args, k, "train")
        k += 1
        key = json.dumps(state["stones"])
        if key in seen:
            continue
        seen.add(key)
        game, openings, acting = open_multi_episode(GomokuDuelGame, env_args, state)
        opening = {o.agent: (o.system_prompt, o.user_message) for o in openings}
        chats: dict[str, list[dict]] = {a: [] for a in opening}
        inbox: dict[str, list[str]] = {a: [] for a in opening}
        rng = random.Random(k)
        while True:
            [seat] = acting
            if not chats[seat]:
                system, user = opening[seat]
                chats[seat] += [{"role": "system", "content": system},
                                {"role": "user", "content": "\n\n".join(x for x in (user, *inbox[seat]) if x)}]
            else:
                chats[seat].append({"role": "user", "content": "\n\n".join(inbox[seat])})
            inbox[seat] = []
            move = cell_name(*rng.choice(empties(game.board)))
            chats[seat].append({"role": "assistant", "content": move})
            reply = take_phase(game, {seat: move}, acting)
            assert not any(reply.info["illegal"].values()), (move, reply.observations)
            for a, text in reply.observations.items():
                inbox[a].append(text)
            if reply.done:
                break
            acting = reply.acting
        rows += [{"messages": chats[a], "seat": a, "result": reply.info["result"]} for a in SEATS]
    return rows


def seat_scores(values: dict[str, float]) -> dict[str, float]:
    """{seat: win_rate/<seat>} of one evaluation's metric values."""
    return {s: round(values[f"win_rate/{s}"], 4) for s in SEATS if f"win_rate/{s}" in values}


async def run_job(client, spec: dict, job_id: str) -> dict:
    """Submit `spec` as `job_id`, print its metrics as they come, wait for the end:
    {"state", "wall_s", "train_reward": [[step, reward_mean]], "evals": {version: values}}."""
    import nats

    from opentinker.schemas.job import SpecError

    t0 = time.monotonic()
    while True:  # the stack may still be starting: no scheduler yet, or no envhost serving the env
        try:
            job = await client.submit(spec, job_id=job_id)
            break
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, SpecError) as e:
            if (isinstance(e, SpecError) and e.field != "env") or time.monotonic() - t0 > 180:
                raise
            await asyncio.sleep(1.0)
    train, evals = [], {}
    async for m in job.metrics():
        if m.split == "eval":
            evals[m.step] = dict(m.values)
            seats = {k: round(v, 3) for k, v in m.values.items() if k.startswith("win_rate")}
            print(f"{job_id} eval after {m.step} steps: {seats}", flush=True)
        elif m.split == "train" and "reward_mean" in m.values:
            train.append([m.step, round(m.values["reward_mean"], 4)])
            print(f"{job_id} step {m.step} reward {m.values['reward_mean']:.3f}", flush=True)
        elif m.split == "train":
            print(f"{job_id} step {m.step} loss {m.values.get('loss', 0):.4f}", flush=True)
    rec = await job.wait(timeout_s=3600, raise_on_failure=False)
    return {"state": rec.state.value, "reason": rec.reason, "wall_s": round(time.monotonic() - t0, 1),
            "train_reward": train, "evals": evals}


def load(config: str, sets: dict) -> dict:
    from opentinker.cli.common import load_job_config

    spec = load_job_config(str(ROOT / config), [])
    spec.update(sets)
    return spec


async def run_seed_async(seed: int, n_demos: int) -> dict:
    from faults import fresh_home
    from opentinker.ops.stack import Stack
    from opentinker.sdk import Client

    home = fresh_home(f"selfplay-s{seed}")
    os.environ["OPENTINKER_HOME"] = str(home)
    sft = load(SFT, {"seed": seed})
    demos = home / "duel_demos.jsonl"
    demos.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n"
                             for r in demonstrations(n_demos, seed, sft["env_args"])))
    stamp = time.strftime("%H%M%S")
    ids = {p: f"duel-{p}-s{seed}-{stamp}" for p in ("sft", "rl", "vs-white", "vs-black")}
    stack = Stack(home).start()
    client = None
    try:
        client = await Client.connect(stack.nats_url)
        jobs = {"sft": await run_job(client, dict(sft, sft_data=str(demos)), ids["sft"])}
        start = str(home / "checkpoints" / ids["sft"] / "final")
        jobs["rl"] = await run_job(client, load(GRPO, {"seed": seed, "model": start}), ids["rl"])
        for seat in SEATS:  # S on `seat`, C on the other
            league = load(GRPO, {"seed": seed, "model": start, "steps": 1, "eval_every": 1,
                                 "opponents": {seat: ids["rl"]}})
            jobs[f"vs-{seat}"] = await run_job(client, league, ids[f"vs-{seat}"])
    finally:
        if client is not None:
            await client.close()
        stack.stop()
    rl = jobs["rl"]
    last = max(rl["evals"]) if rl["evals"] else None
    base = seat_scores(rl["evals"].get(0, {}))
    trained = {s: seat_scores(jobs[f"vs-{s}"]["evals"].get(0, {})).get(s) for s in SEATS}
    rewards = [r for _, r in rl["train_reward"]]

    def mean(xs: list) -> float | None:
        return round(sum(xs) / len(xs), 4) if xs and None not in xs else None

    return {"seed": seed, "demos": n_demos, "job_ids": ids, "states": {k: j["state"] for k, j in jobs.items()},
            "wall_s": {k: j["wall_s"] for k, j in jobs.items()}, "train_reward": rl["train_reward"],
            "first5": mean(rewards[:5]), "last5": mean(rewards[-5:]),
            "start_vs_start": base, "start_vs_start_draw": round(rl["evals"].get(0, {}).get("draw_rate/black", 0), 4),
            "trained_vs_start": trained,
            "trained_vs_trained": seat_scores(rl["evals"][last]) if last else {},
            "start_score": mean([base.get(s) for s in SEATS]),
            "trained_score": mean([trained[s] for s in SEATS]),
            "evals": {k: j["evals"] for k, j in jobs.items() if k != "sft"}}


def summary(runs: list[dict]) -> dict:
    from main_job_seeds import mean_sd

    out = {k: mean_sd([r[k] for r in runs]) for k in ("start_score", "trained_score", "first5", "last5")}
    out["gain"] = mean_sd([r["trained_score"] - r["start_score"] for r in runs
                           if r["trained_score"] is not None and r["start_score"] is not None])
    out["total_s"] = mean_sd([sum(r["wall_s"].values()) for r in runs])
    return out


def report(res: dict) -> str:
    """The markdown table of a results file (the README's numbers)."""
    from provenance import commit_label

    from main_job_seeds import fmt

    s = res["summary"]

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    rows = ["| seed | start vs start: black / white wins | trained vs start: wins as black / as white | "
            "score: start vs start -> trained vs start | self-play train reward, first 5 -> last 5 steps | "
            "wall (4 jobs) |",
            "|---|---|---|---|---|---|"]
    for r in res["runs"]:
        b, t = r["start_vs_start"], r["trained_vs_start"]
        rows.append(f"| {r['seed']} | {f(b.get('black'))} / {f(b.get('white'))} | "
                    f"{f(t.get('black'))} / {f(t.get('white'))} | "
                    f"{f(r['start_score'])} -> {f(r['trained_score'])} | {f(r['first5'])} -> {f(r['last5'])} | "
                    f"{sum(r['wall_s'].values()):.0f} s |")
    rows.append(f"| mean +- sd ({s['gain']['n']} seeds) | | | {fmt(s['start_score'])} -> {fmt(s['trained_score'])} "
                f"(gain {fmt(s['gain'])}) | {fmt(s['first5'])} -> {fmt(s['last5'])} | {fmt(s['total_s'], 0)} s |")
    t = res.get("eval_temperature", 0.0)
    measure = "greedy games" if not t else f"sampled games (temperature {t:g})"
    head = (f"{res['date']}, {commit_label(res)}, {res['machine']}; `{res['command']}` "
            f"(`bench/results/{Path(res['out']).name}`). Held-out: {res['eval_episodes']} {measure} of split "
            f"`test` per evaluation, opening positions training never plays. Start: the cold start on "
            f"scripted games of random legal moves; trained: start + {res['steps']} steps of self-play GRPO; "
            f"score: win rate averaged over the two seats (trained vs start: league play, `opponents`).")
    return head + "\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    from main_job_seeds import write_readme
    from provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--demos", type=int, default=64, help="scripted games for the cold start (two chats each)")
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
    grpo = load(GRPO, {})
    res = {**provenance(),
           "configs": [SFT, GRPO], "eval_episodes": grpo["eval_episodes"], "steps": grpo["steps"],
           "eval_temperature": grpo["eval_temperature"], "out": Path(args.out).name, "runs": []}
    for seed in args.seeds:
        res["runs"].append(asyncio.run(run_seed_async(seed, args.demos)))
        print(json.dumps({k: v for k, v in res["runs"][-1].items() if k not in ("train_reward", "evals")}), flush=True)
        res["summary"] = summary(res["runs"])
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")  # each seed as it lands
    print(report(res))


if __name__ == "__main__":
    main()
