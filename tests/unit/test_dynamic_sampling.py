"""DAPO's dynamic sampling (arXiv 2503.14476 §3.2): a replaced group gets a fresh prompt
whose seed is a pure function of the job seed, step, group and replacement index; the
spec field is bounded; the step's reward_mean counts the replaced groups. The
replacement itself runs through the services in tests/integration/test_objective_jobs.py
("dynamic")."""

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from opentinker.schemas import JobSpec, Trajectory, TurnRecord
from opentinker.schemas.job import spec_from_dict
from opentinker.services.learner.job import group_seed


def test_a_replacement_asks_a_new_prompt_reproducibly():
    first = group_seed(0, 3, 1)
    assert group_seed(0, 3, 1, 0) == first  # no replacement: the seed every run used so far
    refills = [group_seed(0, 3, 1, r) for r in range(1, 6)]
    assert len({first, *refills}) == 6  # each replacement a different prompt
    assert refills == [group_seed(0, 3, 1, r) for r in range(1, 6)]  # and the same on every run
    # not another group's or step's first prompt
    assert not set(refills) & {group_seed(0, s, i) for s in range(10) for i in range(10)}


def test_dynamic_sampling_is_off_by_default_and_bounded():
    assert JobSpec().dynamic_sampling == 0
    assert spec_from_dict({"dynamic_sampling": 4}).dynamic_sampling == 4
    with pytest.raises((msgspec.ValidationError, ValueError), match="dynamic_sampling"):
        spec_from_dict({"dynamic_sampling": -1})


class _Msg:
    """A JetStream message stand-in: counts its acks."""

    def __init__(self):
        self.acked = 0

    async def ack(self):
        self.acked += 1


def _episode(group: int, k: int, reward: float, attempt: int = 0) -> Trajectory:
    return Trajectory(job_id="j", request_id=f"j-s0-g{group}-a{attempt}", episode_id=f"g{group}a{attempt}e{k}",
                      step=0, group_index=group, group_size=2, token_ids=[1, 2, 3], loss_mask=[0, 0, 1],
                      logprobs=[0.0, 0.0, -1.0], prompt_len=2,
                      turns=[TurnRecord(gen_start=2, gen_end=3, obs_end=3, reward=reward)], reward=reward,
                      policy_version=0)


def test_the_step_s_reward_mean_counts_the_groups_dynamic_sampling_replaced():
    """DAPO's dynamic sampling drops the groups whose rewards are all equal and samples
    more (arXiv 2503.14476 §3.2). The step's reward_mean is the policy's: over every
    episode sampled for the step, the replaced groups' too; the trained groups' alone
    is reward_mean_kept."""
    from opentinker.services.learner import job
    from opentinker.services.learner.ledger import TrajectoryLedger

    run = job.JobRun.__new__(job.JobRun)  # the methods under test, without a bus or an engine
    run.spec = JobSpec(prompts_per_step=2, group_size=2, dynamic_sampling=4)
    run.ledger = TrajectoryLedger("j", "", steps=1, prompts_per_step=2, group_size=2)
    run.stats, run.ahead_stats, run.refill_index, run.weights_s, run.step = job.StepStats(), {}, {}, 0.0, 0
    run.engine = SimpleNamespace(world_size=1)
    asked, published = [], {}

    async def request_group(s, i):
        asked.append((s, i))

    async def step_done(s, values, request_ids):
        published.update(values)

    run.request_group, run.step_done = request_group, step_done
    run.ledger.open(0)
    # group 0 solved by both episodes: no signal, replaced by a group that solves 1 of 2
    solved = [job.Held(_episode(0, k, 1.0), _Msg()) for k in range(2)]
    for seq, h in enumerate(solved):
        run.ledger.hold(seq, 0, run.ledger.current_request_id(0, 0), h.traj.episode_id, h)
    assert run.refill_due(0, 0, solved)
    asyncio.run(run.refill_group(0, 0))
    assert asked == [(0, 0)] and all(h.msg.acked == 1 for h in solved)
    trained = [_episode(0, 0, 1.0, 1), _episode(0, 1, 0.0, 1), _episode(1, 0, 0.0), _episode(1, 1, 1.0)]
    out = dict(loss=0.0, grad_norm=0.0, tokens=0.0, excluded_frac=0.0, zero_variance_frac=0.0, skipped_frac=0.0,
               lr=1e-3, updates=1.0, fwd_bwd_s=0.0, optimizer_s=0.0)
    asyncio.run(run.publish_metrics(0, trained, out, 1.0, 1.0))
    assert published["reward_mean"] == pytest.approx((1 + 1 + 1 + 0 + 0 + 1) / 6)  # all 6 sampled
    assert published["reward_mean_kept"] == pytest.approx(2 / 4)  # the 4 trained
    assert published["refilled"] == 1.0


def _ahead_run(max_staleness: int, step: int, asked: list):
    """A JobRun at `step` (policy version = step) with the steps to step + 1 asked for,
    and the stand-ins of test_the_step_s_reward_mean_counts_the_groups_dynamic_sampling_replaced."""
    from opentinker.services.learner import job
    from opentinker.services.learner.ledger import TrajectoryLedger

    run = job.JobRun.__new__(job.JobRun)
    run.spec = JobSpec(prompts_per_step=2, group_size=2, dynamic_sampling=4, max_staleness=max_staleness)
    run.ledger = TrajectoryLedger("j", "", steps=step + 2, prompts_per_step=2, group_size=2)
    run.stats, run.ahead_stats, run.refill_index = job.StepStats(), {}, {}
    run.step = run.version = step
    run.requested_upto, run.sub, run.run_id = step + 1, None, ""
    for s in range(step + 2):
        run.ledger.open(s)

    async def request_group(s, i):
        asked.append((s, i))

    async def on_trajectory(m):  # what JobRun.on_trajectory keeps of a fresh episode
        t = m.traj
        run.ledger.hold(on_trajectory.seq, t.step, run.ledger.current_request_id(t.step, t.group_index),
                        t.episode_id, m)
        on_trajectory.seq += 1

    on_trajectory.seq = 0
    run.request_group, run.on_trajectory = request_group, on_trajectory
    return run


def _held(step: int, group: int, k: int, reward: float, version: int):
    from opentinker.services.learner import job

    t = msgspec.structs.replace(_episode(group, k, reward), step=step, policy_version=version,
                                request_id=f"j-s{step}-g{group}-a0", episode_id=f"s{step}g{group}e{k}")
    return job.Held(t, _Msg())


def test_an_async_job_replaces_a_later_step_s_flat_groups_while_this_step_trains():
    """Asynchronous RL overlaps generation with training (AReaL, arXiv 2505.24298): with
    dynamic sampling, a later step's group without signal is replaced while the current
    step trains, not after; its replacement counts in that step's metrics. A group too
    stale for its step, a group with signal and a synchronous job are left alone."""

    async def main(max_staleness: int, step: int, episodes: list):
        asked: list = []
        run = _ahead_run(max_staleness, step, asked)
        training = asyncio.get_running_loop().create_future()
        fetches = []

        async def fetch(sub, n, timeout_s):
            fetches.append(timeout_s)
            if len(fetches) == 2:
                training.set_result({"loss": 0.5})  # the update ends while the second fetch waits
            return episodes if len(fetches) == 1 else []

        run.bus = SimpleNamespace(fetch=fetch)
        if max_staleness == 0:
            training.set_result({"loss": 0.5})
        assert await run.while_training(training) == {"loss": 0.5}
        return asked, run, fetches

    nxt = 1  # step 0 trains; step 1's episodes were sampled by version 0
    flat = [_held(nxt, 0, k, 1.0, 0) for k in range(2)]  # both solved: no signal
    mixed = [_held(nxt, 1, k, float(k), 0) for k in range(2)]
    asked, run, fetches = asyncio.run(main(1, 0, flat + mixed))
    assert asked == [(1, 0)] and all(h.msg.acked == 1 for h in flat)  # replaced, its episodes acked
    assert run.ahead_stats[1].refilled == 1 and run.ahead_stats[1].refilled_rewards == [1.0, 1.0]
    assert run.stats.refilled == 0 and run.refill_index == {(1, 0): 1}
    assert len(fetches) == 2 and max(fetches) <= 0.2
    # step 3 trains at version 3: episodes of version 1 are 2 behind, past max_staleness 1
    stale = [_held(3, 0, k, 0.0, 1) for k in range(2)]
    assert asyncio.run(main(1, 2, stale))[0] == []
    # a synchronous job asks for nothing ahead, so it fetches nothing while it trains
    asked, run, fetches = asyncio.run(main(0, 0, flat))
    assert (asked, fetches) == ([], [])


def test_a_failure_while_a_step_trains_waits_for_the_update_and_is_raised():
    async def main():
        run = _ahead_run(1, 0, [])
        done = []

        async def update():
            await asyncio.sleep(0.05)
            done.append(True)
            return {"loss": 0.5}

        async def fetch(sub, n, timeout_s):
            raise RuntimeError("group j-s1-g0: 8 attempts dropped")

        run.bus = SimpleNamespace(fetch=fetch)
        with pytest.raises(RuntimeError, match="attempts dropped"):
            await run.while_training(asyncio.ensure_future(update()))
        return done

    assert asyncio.run(main()) == [True]  # the engine's work finished before the error left
