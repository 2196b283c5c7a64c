"""Self-play over seeds (issue 31, README "Self-play over seeds"): both seats of a
two-player game played by the policy in training, then the trained policy against the
policy it started from, seated by league play (`opponents`), against that starting policy
against itself; mean +- sd across seeds.

    .venv/bin/python bench/selfplay_seeds.py [--game negotiation|gomoku-duel] [--seeds 0 1 2]
        [--demos 64] [--out bench/results/selfplay_seeds.json]
    .venv/bin/python bench/selfplay_seeds.py --report [--readme README.md]   # from the file only

Games (GAMES):
- `negotiation` (the default): alice and bob split a pot of 6..12 coins by simultaneous
  demands over up to 3 rounds (the Nash demand game); a deal pays each its demand. The
  start is the base model itself, which already makes a deal in some games (so GRPO has
  reward spread) and mostly asks for too much. Score: the deal rate (`result_rate/deal`).
- `gomoku-duel` (5x5, three in a row): the base model names no legal cell, so the start
  is a cold start, a supervised fine-tuning on scripted train-split games in which both
  seats play a uniformly random empty cell, each seat's side one chat as the rollout's
  coordinator shows it (DeepSeek-R1, arXiv 2501.12948 §2.3.1, as bench/tool_use_seeds.py).
  Score: the win rate (`win_rate/<seat>`). Its ~450-token seat chats make a seed ~30 min
  here; negotiation's are ~250 tokens.

Per seed, one embedded stack (ops.stack.Stack: nats-server and every service as its own
process) in a fresh home under bench/results/tmp/ (the main home's converted model and
compiled ops shared), the jobs submitted through the SDK:

1. (gomoku-duel) the SFT config on `--demos` games (full fine-tuning): the start C, a
   whole model at `<home>/checkpoints/<job>/final`; (negotiation) C is the base model;
2. the GRPO config from C: self-play with LoRA, S. Its evaluation at step 0 is C against
   itself;
3. one league evaluation per seat, a one-step job on C with S's final policy on that seat
   (`opponents = {<seat> = S}`): its evaluation at step 0 is S against C.

Held-out: the learner's evaluations (`eval_episodes` games of split "test", sampled at
`eval_temperature`). A score against another policy is averaged over the two seats (in
gomoku-duel black moves first, so one seat alone would mostly measure that advantage).
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
# game -> its seats, SFT config (None: the start is the base model), GRPO config, and the
# score of a seat in an evaluation's metrics
GAMES = {
    "negotiation": {"seats": ("alice", "bob"), "sft": None, "grpo": "examples/negotiation_grpo.toml",
                    "score": "result_rate/deal"},
    "gomoku-duel": {"seats": ("black", "white"), "sft": "examples/gomoku_duel_sft.toml",
                    "grpo": "examples/gomoku_duel_grpo.toml", "score": "win_rate/{seat}"},
}
MARKER = "selfplay_seeds"
SEATS = GAMES["gomoku-duel"]["seats"]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from main_job_seeds import load_config as load  # noqa: E402 (bench/ on the path first)


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


def seat_scores(values: dict[str, float], game: str = "gomoku-duel") -> dict[str, float]:
    """{seat: the game's score of that seat} in one evaluation's metric values (seats
    without the metric left out)."""
    g = GAMES[game]
    keys = {seat: g["score"].format(seat=seat) for seat in g["seats"]}
    return {seat: round(values[k], 4) for seat, k in keys.items() if k in values}


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
            seats = {k: round(v, 3) for k, v in m.values.items() if k.startswith(("win_rate", "result_rate"))}
            print(f"{job_id} eval after {m.step} steps: {seats}", flush=True)
        elif m.split == "train" and "reward_mean" in m.values:
            train.append([m.step, round(m.values["reward_mean"], 4)])
            print(f"{job_id} step {m.step} reward {m.values['reward_mean']:.3f}", flush=True)
        elif m.split == "train":
            print(f"{job_id} step {m.step} loss {m.values.get('loss', 0):.4f}", flush=True)
    rec = await job.wait(timeout_s=3600, raise_on_failure=False)
    return {"state": rec.state.value, "reason": rec.reason, "wall_s": round(time.monotonic() - t0, 1),
            "train_reward": train, "evals": evals}


async def run_seed_async(game: str, seed: int, n_demos: int) -> dict:
    from faults import fresh_home
    from opentinker.ops.stack import Stack
    from opentinker.sdk import Client

    g = GAMES[game]
    home = fresh_home(f"selfplay-s{seed}")
    os.environ["OPENTINKER_HOME"] = str(home)
    stamp = time.strftime("%H%M%S")
    ids = {p: f"{game}-{p}-s{seed}-{stamp}" for p in ("sft", "rl", *(f"vs-{a}" for a in g["seats"]))}
    stack = Stack(home).start()
    client, jobs = None, {}
    try:
        client = await Client.connect(stack.nats_url)
        start = load(g["grpo"])["model"]
        if g["sft"]:
            sft = load(g["sft"], seed=seed)
            demos = home / "duel_demos.jsonl"
            demos.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n"
                                     for r in demonstrations(n_demos, seed, sft["env_args"])))
            jobs["sft"] = await run_job(client, dict(sft, sft_data=str(demos)), ids["sft"])
            start = str(home / "checkpoints" / ids["sft"] / "final")
        jobs["rl"] = await run_job(client, load(g["grpo"], seed=seed, model=start), ids["rl"])
        for seat in g["seats"]:  # S on `seat`, C on the other
            league = load(g["grpo"], seed=seed, model=start, steps=1, eval_every=1,
                                      opponents={seat: ids["rl"]})
            jobs[f"vs-{seat}"] = await run_job(client, league, ids[f"vs-{seat}"])
    finally:
        if client is not None:
            await client.close()
        stack.stop()
    rl = jobs["rl"]
    last = max(rl["evals"]) if rl["evals"] else None
    base = seat_scores(rl["evals"].get(0, {}), game)
    trained = {s: seat_scores(jobs[f"vs-{s}"]["evals"].get(0, {}), game).get(s) for s in g["seats"]}
    coins = {s: jobs[f"vs-{s}"]["evals"].get(0, {}).get(f"reward_mean/{s}") for s in g["seats"]}
    rewards = [r for _, r in rl["train_reward"]]

    def mean(xs: list) -> float | None:
        return round(sum(xs) / len(xs), 4) if xs and None not in xs else None

    return {"seed": seed, "game": game, "demos": n_demos if g["sft"] else 0, "job_ids": ids,
            "states": {k: j["state"] for k, j in jobs.items()},
            "wall_s": {k: j["wall_s"] for k, j in jobs.items()}, "train_reward": rl["train_reward"],
            "first5": mean(rewards[:5]), "last5": mean(rewards[-5:]),
            "start_vs_start": base, "trained_vs_start": trained,
            "trained_reward_vs_start": coins,
            "start_reward_vs_start": {s: rl["evals"].get(0, {}).get(f"reward_mean/{s}") for s in g["seats"]},
            "trained_vs_trained": seat_scores(rl["evals"][last], game) if last else {},
            "start_score": mean([base.get(s) for s in g["seats"]]),
            "trained_score": mean([trained[s] for s in g["seats"]]),
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
    from main_job_seeds import fmt
    from provenance import commit_label

    s = res["summary"]
    game = res.get("game", "gomoku-duel")
    a, b = GAMES[game]["seats"]
    what = "deal rate" if game == "negotiation" else "wins"

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    rows = [f"| seed | start vs start: {what}, {a} / {b} | trained vs start: {what}, trained as {a} / as {b} | "
            "score: start vs start -> trained vs start | self-play train reward, first 5 -> last 5 steps | "
            "wall (all jobs) |",
            "|---|---|---|---|---|---|"]
    for r in res["runs"]:
        st, tr = r["start_vs_start"], r["trained_vs_start"]
        rows.append(f"| {r['seed']} | {f(st.get(a))} / {f(st.get(b))} | {f(tr.get(a))} / {f(tr.get(b))} | "
                    f"{f(r['start_score'])} -> {f(r['trained_score'])} | {f(r['first5'])} -> {f(r['last5'])} | "
                    f"{sum(r['wall_s'].values()):.0f} s |")
    rows.append(f"| mean +- sd ({s['gain']['n']} seeds) | | | {fmt(s['start_score'])} -> {fmt(s['trained_score'])} "
                f"(gain {fmt(s['gain'])}) | {fmt(s['first5'])} -> {fmt(s['last5'])} | {fmt(s['total_s'], 0)} s |")
    t = res.get("eval_temperature", 0.0)
    measure = "greedy games" if not t else f"sampled games (temperature {t:g})"
    if game == "negotiation":
        start = "the base model"
        held = "the held-out pot"
        score = "the deal rate"
    else:
        start = "the cold start on scripted games of random legal moves"
        held = "opening positions training never plays"
        score = "the win rate averaged over the two seats"
    head = (f"{res['date']}, {commit_label(res)}, {res['machine']}; `{res['command']}` "
            f"(`bench/results/{Path(res['out']).name}`). {game} ({res['configs'][-1]}); held-out: "
            f"{res['eval_episodes']} {measure} of split `test` per evaluation, {held}. Start: {start}; trained: "
            f"start + {res['steps']} steps of self-play GRPO; score: {score} (trained vs start: league play, "
            "`opponents`, the trained policy on one seat and the start on the other).")
    return head + "\n\n" + "\n".join(rows) + "\n"


def main() -> None:
    from main_job_seeds import report_only, run_seeds, seeds_arguments
    from provenance import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    seeds_arguments(ap, OUT)
    ap.add_argument("--game", choices=sorted(GAMES), default="negotiation")
    ap.add_argument("--demos", type=int, default=64, help="gomoku-duel: scripted games for the cold start")
    args = ap.parse_args()
    if report_only(args, report, MARKER):
        return
    g = GAMES[args.game]
    grpo = load(g["grpo"])
    res = {**provenance(), "game": args.game, "configs": [c for c in (g["sft"], g["grpo"]) if c],
           "eval_episodes": grpo["eval_episodes"], "steps": grpo["steps"],
           "eval_temperature": grpo["eval_temperature"], "out": Path(args.out).name}
    run_seeds(res, args.seeds, lambda seed: asyncio.run(run_seed_async(args.game, seed, args.demos)),
              summary, report, args.out, args.append)

if __name__ == "__main__":
    main()
