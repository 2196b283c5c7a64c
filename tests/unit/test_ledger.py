"""The learner's trajectory ledger, alone: redeliveries, late and duplicate episodes,
complete groups, attempts, the stream position a checkpoint records, and a resume
that neither loses nor repeats a trajectory."""

from opentinker.services.learner.ledger import Delivery, TrajectoryLedger, no_stream_meta, request_id


def ledger(steps=3, groups=2, size=2, run="r1") -> TrajectoryLedger[str]:
    led = TrajectoryLedger("j", run, steps, groups, size)
    led.open(0)
    return led


def offer(led: TrajectoryLedger[str], seq: int, step: int, group: int, episode: str,
          rid: str | None = None, next_step: int = 0) -> str:
    """What the learner does with one delivery, as a word."""
    d = led.deliver(seq)
    if d is not Delivery.NEW:
        return d.value
    if not led.admit(step, group, next_step):
        return "late"
    rid = rid or led.current_request_id(step, group)
    return "held" if led.hold(seq, step, rid, episode, f"m{seq}") else "duplicate"


def test_request_ids_name_step_group_attempt_and_run():
    assert request_id("j", 3, 1, 0, "r1") == "j-s3-g1-rr1"
    assert request_id("j", 3, 1, 2, "r1") == "j-s3-g1-a2-rr1"
    assert request_id("j", 3, 1, 0) == "j-s3-g1"


def test_a_redelivered_sequence_is_ignored_and_a_duplicate_episode_refused():
    led = ledger()
    assert offer(led, 1, 0, 0, "e0") == "held"
    assert offer(led, 1, 0, 0, "e0") == "redelivered"
    assert offer(led, 2, 0, 0, "e0") == "duplicate"      # same episode, new sequence
    assert offer(led, 3, 0, 0, "e1") == "held"
    assert offer(led, 4, 0, 0, "e2") == "duplicate"      # the group has its 2 episodes
    assert led.group(0, 0) == ["m1", "m3"]


def test_a_trained_step_or_a_group_outside_the_job_is_late():
    led = ledger(steps=3, groups=2)
    assert offer(led, 1, 0, 0, "e0", next_step=1) == "late"
    assert offer(led, 2, 3, 0, "e0", next_step=1) == "late"   # past the last step
    assert offer(led, 3, 1, 2, "e0", next_step=1) == "late"   # no group 2
    assert 1 not in led.attempts
    # a step the lost run asked for but this one not yet: admitted, and opened
    assert offer(led, 4, 2, 1, "e0", next_step=1) == "held" and led.attempts[2] == [0, 0]


def test_a_step_is_complete_when_every_groups_current_attempt_is_full():
    led = ledger(groups=2, size=2)
    for seq, (g, e) in enumerate([(0, "a"), (0, "b"), (1, "a")], 1):
        offer(led, seq, 0, g, e)
    assert not led.complete(0)
    offer(led, 4, 0, 1, "b")
    assert led.complete(0)
    assert [led.group(0, i) for i in range(2)] == [["m1", "m2"], ["m3", "m4"]]


def test_a_stale_runs_trajectory_never_counts_toward_a_group():
    led = ledger(groups=1, size=1)
    lost = request_id("j", 0, 0, 0, "r0")  # the same group, asked by a run that did not survive
    assert offer(led, 1, 0, 0, "e0", rid=lost) == "held"
    assert led.group(0, 0) == [] and not led.complete(0)
    assert offer(led, 2, 0, 0, "e0") == "held" and led.complete(0)
    # training the step uses this run's episode; the lost run's comes back to be acked
    assert led.take_step(0) == ["m1"]
    assert led.position() == (2, [])


def test_dropping_an_attempt_returns_its_episodes_and_counts_it():
    led = ledger(groups=2, size=2)
    offer(led, 1, 0, 1, "e0")
    assert led.attempt(0, 1) == 0
    assert led.drop(0, 1) == ["m1"]
    assert led.attempt(0, 1) == 1 and led.attempt(0, 0) == 0
    assert led.current_request_id(0, 1) == "j-s0-g1-a1-rr1"
    assert led.group(0, 1) == []
    # the old attempt's late arrival is held apart, and acked when the step is trained
    assert offer(led, 2, 0, 1, "e1", rid="j-s0-g1-rr1") == "held"
    offer(led, 3, 0, 1, "e0")
    assert led.group(0, 1) == ["m3"]
    led.drop(0, 1)
    assert led.attempts == {0: [0, 2]}


def test_asked_times_are_per_group_with_a_default():
    led = ledger()
    led.ask(0, 1, 100.0)
    assert led.asked_at(0, 1, 5.0) == 100.0 and led.asked_at(0, 0, 5.0) == 5.0


def test_the_floor_stays_below_held_trajectories_of_later_steps():
    led = ledger(steps=3, groups=1, size=1)
    led.open(1)
    offer(led, 1, 0, 0, "a")
    offer(led, 2, 1, 0, "a")   # step 1's, still held when step 0 checkpoints
    assert offer(led, 3, 0, 0, "b") == "duplicate"
    assert led.take_step(0) == []
    assert led.position() == (1, [])
    assert led.meta(0) == {"traj_floor": 1, "traj_used": [], "attempts": {1: [0]}}


def test_checkpoint_keys_and_pruning():
    led = ledger(steps=3, groups=1, size=1)
    led.open(1)
    offer(led, 5, 1, 0, "a")   # step 1's episode arrives first
    offer(led, 6, 0, 0, "a")
    assert led.drop(0, 0) == ["m6"]   # step 0's first attempt dropped (stale, say)
    offer(led, 7, 0, 0, "b")
    assert led.take_step(0) == []
    assert led.position() == (4, [7])   # 5 is held for step 1: the replay starts there
    assert led.meta(0) == {"traj_floor": 4, "traj_used": [7], "attempts": {1: [0]}}
    led.prune(4)
    assert led.floor == 4 and led.seen == {5, 6, 7} and led.used == {7}
    # once step 1 is trained too, everything seen is consumed
    assert led.take_step(1) == []
    assert led.position() == (7, [])
    led.prune(7)
    assert led.seen == set() and led.used == set()


def test_a_resumed_ledger_skips_what_the_checkpointed_steps_used():
    before = ledger(steps=3, groups=1, size=1, run="r0")
    before.open(1)
    assert before.drop(1, 0) == []    # step 1 is on its second attempt
    offer(before, 1, 1, 0, "x")       # step 1's episode, held across the checkpoint
    offer(before, 2, 0, 0, "a")
    before.take_step(0)
    meta = before.meta(0)
    assert meta == {"traj_floor": 0, "traj_used": [2], "attempts": {1: [1]}}

    after = TrajectoryLedger[str]("j", "r1", 3, 1, 1)
    after.restore(meta)
    assert after.floor == 0 and after.attempts == {1: [1]}
    assert after.current_request_id(1, 0) == "j-s1-g0-a1-rr1"
    # the replay from floor + 1: seq 1 (the lost run's) is new again, seq 2 trained step 0
    assert offer(after, 1, 1, 0, "x", rid="j-s1-g0-a1-rr0", next_step=1) == "held"
    assert offer(after, 2, 0, 0, "a", next_step=1) == "used"
    assert offer(after, 2, 0, 0, "a", next_step=1) == "redelivered"
    assert offer(after, 3, 1, 0, "y", next_step=1) == "held"
    assert after.complete(1)
    assert after.take_step(1) == ["m1"]
    assert after.position() == (3, [])


def test_restore_reads_checkpoints_with_string_step_keys():
    led = TrajectoryLedger[str]("j", "r1", 5, 2, 1)
    led.restore({"traj_floor": 10, "traj_used": [12, 14], "attempts": {"4": [0, 1]}})
    assert led.floor == 10 and led.skip == {12, 14} and led.attempts == {4: [0, 1]}
    assert led.position() == (10, [12, 14])
    assert led.meta(3) == {"traj_floor": 10, "traj_used": [12, 14], "attempts": {4: [0, 1]}}
    assert led.meta(4)["attempts"] == {}


def test_position_round_trips_through_restore():
    led = ledger(steps=4, groups=1, size=1)
    for s in (1, 2):
        led.open(s)
    offer(led, 1, 0, 0, "a")
    offer(led, 2, 2, 0, "a")
    offer(led, 3, 1, 0, "a")
    led.take_step(0)
    led.take_step(1)
    meta = led.meta(1)
    assert meta == {"traj_floor": 1, "traj_used": [3], "attempts": {2: [0]}}
    again = TrajectoryLedger[str]("j", "r2", 4, 1, 1)
    again.restore(meta)
    assert again.meta(1) == meta


def test_a_run_without_trajectories_writes_the_same_keys():
    assert no_stream_meta() == {"traj_floor": 0, "traj_used": [], "attempts": {}}
    assert TrajectoryLedger("j", "r", 1, 1, 1).meta(0) == no_stream_meta()


def test_the_floor_never_moves_back():
    led = TrajectoryLedger[str]("j", "r1", 3, 1, 1)
    led.restore({"traj_floor": 10, "traj_used": [], "attempts": {}})
    assert offer(led, 4, 1, 0, "a", next_step=1) == "held"   # below the floor: a stray redelivery
    assert led.position() == (10, [])
