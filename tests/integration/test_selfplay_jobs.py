"""Multi-agent self-play through the real services: gomoku-duel (turn-based) and
negotiation (simultaneous demands), each a job with `agents = 2` on the tiny model.
Both seats' trajectories land in the Parquet log, paired by game, with token-exact
masks and their own rewards; the metrics carry one reward curve per seat and
`opentinker plot` draws them."""

import json

import pytest

from opentinker.cli.views import plot
from opentinker.schemas import JobState, SamplingParams, SpecError
from opentinker.sdk import Client
from opentinker.services.core.logdb import run_query

from conftest import log_rows, train_jobs
from test_env_jobs import check_episode, spec, start_stack


async def test_self_play_jobs_log_both_seats_and_plot_per_agent_rewards(services, nats_url, tmp_path,
                                                                          tiny_model, job_id):
    data_dir = tmp_path / "log"
    start_stack(services, data_dir)
    jobs = {
        "gomoku-duel": spec(tiny_model, "gomoku-duel", agents=2, advantage="turn", turn_discount=0.9,
                            env_args={"size": 5, "win_length": 3, "illegal": "random"},
                            sampling={"max_new_tokens": 5, "max_turns": 3, "max_total_tokens": 1536}),
        "negotiation": spec(tiny_model, "negotiation", agents=2, env_args={"rounds": 2},
                            sampling={"max_new_tokens": 4, "max_turns": 2, "max_total_tokens": 1024}),
    }
    handles, metrics = await train_jobs(nats_url, services, jobs, job_id, 900)
    for env, h in handles.items():
        s = jobs[env]
        n = s["steps"] * s["prompts_per_step"] * s["group_size"] * 2  # one trajectory per seat
        await log_rows(data_dir, f"SELECT count(*) FROM trajectories WHERE job_id = '{h.id}'", n)
        cols, rows = run_query(f"SELECT agent, game_id, episode_id, reward, token_ids, loss_mask, logprobs, "
                               f"prompt_len, turns, env_info, error FROM trajectories WHERE job_id = '{h.id}'",
                               str(data_dir))
        eps = [dict(zip(cols, r)) for r in rows]
        assert len(eps) == n
        games: dict[str, dict[str, dict]] = {}
        for ep in eps:
            assert not ep["error"], ep["error"]
            check_episode(ep)
            assert ep["episode_id"] == f"{ep['game_id']}-{ep['agent']}"
            games.setdefault(ep["game_id"], {})[ep["agent"]] = ep
        seats = ("black", "white") if env == "gomoku-duel" else ("alice", "bob")
        assert len(games) == n // 2 and all(sorted(g) == sorted(seats) for g in games.values())
        for g in games.values():
            a, b = (g[x] for x in seats)
            assert json.loads(a["env_info"]) == json.loads(b["env_info"])  # one game, seen by both
            if env == "gomoku-duel":
                assert a["turns"] and b["turns"], "both seats moved"
                info = json.loads(a["env_info"])
                if info["result"] in seats:  # a win: +1 for the winner's seat, -1 for the other's
                    win, lose = (a, b) if info["result"] == seats[0] else (b, a)
                    assert win["turns"][-1]["reward"] > 0.5 > -0.5 > lose["turns"][-1]["reward"]
            else:  # simultaneous: every phase both act
                assert len(a["turns"]) == len(b["turns"])
                info = json.loads(a["env_info"])
                if info["result"] == "deal":
                    assert a["reward"] > 0 or info["demands"]["alice"] == 0
        train = [m for m in metrics[env] if m.split == "train"]
        assert [m.step for m in train] == [0, 1]
        assert all(f"reward_mean/{x}" in m.values for m in train for x in seats)
        files = plot(h.id, data_dir, tmp_path / f"plots-{env}")
        assert tmp_path / f"plots-{env}" / "agents.png" in files
    # the trained policy plays both seats again through `infer` (agents from the job)
    async with await Client.connect(nats_url) as client:
        res = await client.infer(env="gomoku-duel", env_args=jobs["gomoku-duel"]["env_args"],
                                 job=handles["gomoku-duel"].id, episodes=2, timeout_s=300,
                                 out_dir=tmp_path / "infer", sampling=SamplingParams(
                                     temperature=0.0, max_new_tokens=5, max_turns=3, max_total_tokens=1536))
    by_game: dict[str, list[str]] = {}
    for t in res.trajectories:
        by_game.setdefault(t.game_id, []).append(t.agent)
    assert len(by_game) == 2 and all(sorted(seats) == ["black", "white"] for seats in by_game.values())
    assert all(t.turns and not t.error for t in res.trajectories)
    assert res.summary["policy_version"] == 1
    # a job that does not give the game its seats fails at once, saying what to set
    async with await Client.connect(nats_url) as client:
        bad = await client.submit(spec(tiny_model, "gomoku-duel"), job_id=f"{job_id}-one-seat")
        rec = await bad.wait(timeout_s=120, raise_on_failure=False)
    assert rec.state == JobState.FAILED and "set agents = 2" in rec.reason, rec
    # league play: a new job's black against the trained gomoku-duel job's policy on white
    champ = handles["gomoku-duel"].id
    # (its evaluations, before and after its step, seat the champion too)
    league = {**jobs["gomoku-duel"], "steps": 1, "opponents": {"white": champ}, "eval_every": 1,
              "eval_episodes": 1, "eval_split": "test"}
    async with await Client.connect(nats_url) as client:
        for bad_spec, why in (({**league, "opponents": {"white": "no-such-job"}}, "no job 'no-such-job' of yours"),
                              ({**league, "model": "smollm2-135m-instruct"}, "same model")):
            with pytest.raises(SpecError) as e:
                await client.submit(bad_spec)
            assert e.value.field == "opponents" and why in str(e.value), e.value
    got_handles, got_metrics = await train_jobs(nats_url, services, {"league": league}, job_id, 600)
    h = got_handles["league"]
    n = league["prompts_per_step"] * league["group_size"] * 2
    await log_rows(data_dir, f"SELECT count(*) FROM trajectories WHERE job_id = '{h.id}' AND split = 'train'", n)
    cols, rows = run_query(f"SELECT agent, policy_of, turns, error FROM trajectories WHERE job_id = '{h.id}' "
                           "AND split = 'train'", str(data_dir))
    eps = [dict(zip(cols, r)) for r in rows]
    assert len(eps) == n and not any(ep["error"] for ep in eps)
    for ep in eps:
        # white: the champion's newest trained policy; black: this job's own (its base at step 0)
        assert ep["policy_of"] == (champ if ep["agent"] == "white" else "")
        assert ep["turns"] and all((t["policy_version"] >= 1) == (ep["agent"] == "white") for t in ep["turns"])
    # the evaluations at versions 0 and 1: one game each, white the champion's, reported per seat
    await log_rows(data_dir, f"SELECT count(*) FROM trajectories WHERE job_id = '{h.id}' AND split = 'test'", 4)
    cols, rows = run_query(f"SELECT agent, policy_of, step FROM trajectories WHERE job_id = '{h.id}' "
                           "AND split = 'test'", str(data_dir))
    assert sorted((a, p, s) for a, p, s in rows) == [("black", "", 0), ("black", "", 1),
                                                     ("white", champ, 0), ("white", champ, 1)]
    evals = [m for m in got_metrics["league"] if m.split == "eval"]
    assert [m.step for m in evals] == [0, 1]
    # per seat: its reward; the games' results (a 3-move game may end unfinished: "ongoing")
    assert all(f"reward_mean/{seat}" in m.values for m in evals for seat in ("black", "white"))
    assert all(sum(v for k, v in m.values.items() if k.startswith("result_rate/")) == 1.0 for m in evals)
