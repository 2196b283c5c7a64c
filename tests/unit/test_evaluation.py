"""Periodic evaluation: when it is due, what it asks for, how its episodes are told from
training ones, how it is summarized."""

from opentinker.schemas import JobSpec, Trajectory, TurnRecord
from opentinker.services.learner.evaluation import Evaluator


def traj(req_id: str, ep: str, reward: float, correct=None, step: int = 0, split: str = "test",
         purpose: str = "eval") -> Trajectory:
    info = {} if correct is None else {"correct": correct}
    return Trajectory(job_id="j", request_id=req_id, episode_id=ep, step=step, group_index=0, group_size=1,
                      token_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0, -1, -1], prompt_len=1,
                      turns=[TurnRecord(gen_start=1, gen_end=3, obs_end=3, reward=reward)], reward=reward,
                      policy_version=0, env_info=info, split=split, purpose=purpose)


def test_due_at_start_every_n_and_at_the_end():
    ev = Evaluator("j", JobSpec(steps=7, eval_every=3))
    assert [v for v in range(8) if ev.due(v)] == [0, 3, 6, 7]
    assert not Evaluator("j", JobSpec(steps=7)).due(0)


def test_requests_are_greedy_single_episodes_of_the_same_problems():
    spec = JobSpec(steps=4, eval_every=2, eval_episodes=3, eval_split="test", eval_temperature=0.0)
    ev = Evaluator("j", spec)
    r0, r2 = ev.requests(0), ev.requests(2)
    assert [r.request_id for r in r0] == ["j-eval-v0-e0", "j-eval-v0-e1", "j-eval-v0-e2"]
    assert [r.group_seed for r in r0] == [r.group_seed for r in r2]
    assert all(r.group_size == 1 and r.split == "test" and r.sampling.temperature == 0.0 for r in r0)
    assert [r.policy_version for r in r2] == [2, 2, 2]
    assert not ev.due(2)  # already pending


def test_metrics_once_every_episode_is_in():
    ev = Evaluator("j", JobSpec(steps=2, eval_every=1, eval_episodes=2))
    ev.requests(1)
    assert ev.add(traj("j-eval-v1-e0", "j-eval-v1-e0-e0", 1.0, correct=True, step=1)) is None
    assert ev.add(traj("j-eval-v9-e0", "x", 1.0, step=9)) is None  # not asked for: ignored
    m = ev.add(traj("j-eval-v1-e1", "j-eval-v1-e1-e0", 0.0, correct=False, step=1))
    assert m is not None and m.split == "eval" and m.step == 1 and m.policy_version == 1
    assert m.values["reward_mean"] == 0.5 and m.values["correct_frac"] == 0.5
    assert m.values["episodes"] == 2.0 and not ev.pending


def test_eval_episodes_are_told_apart_from_training_ones_by_their_purpose():
    ev = Evaluator("j", JobSpec(steps=2, eval_every=1, eval_episodes=1), run="r1")
    assert not ev.claims(traj("j-s0-g0-rr1", "a", 1.0, split="train", purpose="train"))
    # a lost run's eval episode is claimed (never trained on) but not counted
    lost = traj("j-eval-v0-rr0-e0", "b", 1.0)
    assert ev.claims(lost)
    ev.requests(0)
    assert ev.add(lost) is None and 0 in ev.pending
    m = ev.add(traj("j-eval-v0-rr1-e0", "c", 1.0))
    assert m is not None and m.step == 0 and m.values["episodes"] == 1.0


def test_an_eval_split_of_train_is_still_an_evaluation():
    ev = Evaluator("j", JobSpec(steps=2, eval_every=1, eval_episodes=1, eval_split="train"), run="r1")
    [req] = ev.requests(1)
    assert req.split == "train" and req.purpose == "eval"
    assert ev.claims(traj(req.request_id, "a", 1.0, step=1, split="train", purpose=req.purpose))
    assert not ev.claims(traj("j-s1-g0-rr1", "b", 1.0, step=1, split="train", purpose="train"))


def test_an_episode_without_a_correct_flag_counts_by_its_reward():
    assert traj("r", "e", 1.0).correct and not traj("r", "e", 0.0).correct
    assert not traj("r", "e", 1.0, correct=False).correct


def test_an_evaluation_reports_standard_errors_and_episodes_off_its_version():
    import math

    import msgspec

    from opentinker.services.learner.evaluation import eval_stats

    def at(t: Trajectory, *versions: int, policy_of: str = "") -> Trajectory:
        turns = [msgspec.structs.replace(t.turns[0], policy_version=v) for v in versions]
        return msgspec.structs.replace(t, turns=turns, policy_of=policy_of)

    rewards = [1.0, 0.0, 1.0, 1.0]
    trajs = [at(traj(f"r{i}", f"e{i}", r, correct=r > 0), 3) for i, r in enumerate(rewards)]
    values = eval_stats(trajs, 3)
    se = math.sqrt(sum((r - 0.75) ** 2 for r in rewards) / 3) / 2  # sample sd / sqrt(n)
    assert values["reward_se"] == values["correct_se"] == se and values["off_version_frac"] == 0.0
    trajs[0] = at(trajs[0], 3, 4)  # a second turn sampled by a newer version
    trajs.append(at(traj("r9", "e9", 0.0), 7, policy_of="other-job"))  # an opponent's seat: not counted
    assert eval_stats(trajs, 3)["off_version_frac"] == 0.25
    assert eval_stats(trajs[:1], 3)["reward_se"] == 0.0  # one episode has no spread to report


def test_a_league_evaluation_seats_the_opponents_job_as_training_does():
    spec = JobSpec(steps=2, eval_every=1, eval_episodes=2, env="gomoku-duel", agents=2,
                   opponents={"white": "champion"})
    assert all(r.opponents == {"white": "champion"} for r in Evaluator("j", spec).requests(0))


def test_a_multi_agent_evaluation_reports_each_seats_win_rate():
    import msgspec

    from opentinker.services.learner.evaluation import eval_stats

    def seat(i: int, agent: str, result: str, policy_of: str = "") -> Trajectory:
        t = traj(f"r{i}", f"e{i}-{agent}", 1.0 if result == agent else -1.0)
        return msgspec.structs.replace(t, agent=agent, policy_of=policy_of, env_info={"result": result},
                                       game_id=f"g{i}")

    games = ["black", "black", "white", "draw"]  # gomoku-duel's result names the winning seat
    trajs = [seat(i, a, r, "champion" if a == "white" else "") for i, r in enumerate(games) for a in ("black", "white")]
    values = eval_stats(trajs, 0)
    assert values["win_rate/black"] == 0.5 and values["win_rate/white"] == 0.25
    assert values["draw_rate/black"] == values["draw_rate/white"] == 0.25
    assert values["loss_rate/white"] == 0.5
    assert values["result_rate/black"] == 0.5 and values["result_rate/draw"] == 0.25
    assert values["reward_mean/black"] == 0.0  # +1, +1, -1, -1 (a draw scores -1 in this toy)
    # negotiation's results say whether a deal was made, not who won: rates per result only
    deals = eval_stats([seat(i, a, r) for i, r in enumerate(["deal", "no_deal", "deal", "deal"])
                        for a in ("alice", "bob")], 0)
    assert deals["result_rate/deal"] == 0.75 and deals["result_rate/no_deal"] == 0.25
    assert not any(k.startswith(("win_rate", "loss_rate", "draw_rate")) for k in deals)
    assert "win_rate" not in values  # gomoku-duel's results name the winning seat: per seat only
    single = eval_stats([msgspec.structs.replace(traj("r", "e", 1.0), env_info={"result": "win"})], 0)
    assert single["win_rate"] == 1.0 and not any("/" in k for k in single)
