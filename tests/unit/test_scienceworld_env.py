"""The ScienceWorld env on the real simulator (the `scienceworld` package's jar on a
local Java runtime): seeded states on ScienceWorld's own variation split, score deltas
as rewards, the library's gold action sequence solving a task, invalid and failing
actions, and replays when episodes share one simulator."""

import pytest

from opentinker.services.envhost.envs import scienceworld as sw
from opentinker.services.envhost.envs.scienceworld import ScienceWorldGame, parse_action
from opentinker.services.envhost.service import initial_state, open_episode, take_step


def gold_actions(task: str, variation: int) -> list[str]:
    """ScienceWorld's own gold action sequence for a variation (easy simplifications)."""
    with sw.pool().lease() as sim:
        sim.owner = None
        sim.env.load(task, variation, "easy", generateGoldPath=True)
        return sim.env.get_gold_action_sequence()


def play(game: ScienceWorldGame, actions: list[str]):
    results = []
    for a in actions:
        results.append(game.step(a))
        if results[-1].done:
            break
    return results


def test_env_args_are_checked_with_the_field_named():
    for bad, field in (({"task": "make-coffee"}, "env_args.task"), ({"task": 99}, "env_args.task"),
                       ({"task": []}, "env_args.task"), ({"simplification": "easy,fast"}, "env_args.simplification"),
                       ({"task": "power-component", "simplification": "noElectricalAction"},
                        "env_args.simplification"),
                       ({"max_turns": 0}, "env_args.max_turns"), ({"show_valid_actions": "yes"},
                                                                   "env_args.show_valid_actions")):
        with pytest.raises(ValueError, match=field):
            ScienceWorldGame(**bad)
    g = ScienceWorldGame(task=["4-1", "find-plant", 0, "Classification Find a plant"])
    assert g.tasks == ("find-living-thing", "find-plant", "boil")
    assert len(ScienceWorldGame(task="all").tasks) == 30


def test_parse_action_takes_the_first_line():
    assert parse_action("\n  Action: go to kitchen.\nI will then look.") == "go to kitchen"
    assert parse_action("> `open door to outside`") == "open door to outside"
    assert parse_action("   \n") == ""


def test_states_are_seeded_and_train_and_test_variations_are_disjoint():
    g = ScienceWorldGame()
    for task in g.tasks:
        v = sw.variations(task)
        assert v["train"] and v["test"] and not set(v["train"]) & set(v["test"])
        assert not set(v["dev"]) & (set(v["train"]) | set(v["test"]))
    train = [g.generate_initial_state(s, "train") for s in range(20)]
    test = [g.generate_initial_state(s, "test") for s in range(20)]
    assert train == [ScienceWorldGame().generate_initial_state(s, "train") for s in range(20)]
    assert all(st["variation"] in sw.variations(st["task"])["train"] for st in train)
    assert all(st["variation"] in sw.variations(st["task"])["test"] for st in test)
    assert len({(st["task"], st["variation"]) for st in train}) > 10
    assert {st["task"] for st in train} == set(g.tasks)


def test_gold_actions_solve_the_task_and_rewards_are_score_deltas():
    task, variation = "find-living-thing", sw.variations("find-living-thing")["test"][0]
    g = ScienceWorldGame(task=task)
    g.reset(task=task, variation=variation)
    results = play(g, gold_actions(task, variation))
    assert results[-1].done and results[-1].info["won"] and results[-1].info["score"] == 100
    total = 0.0
    for r in results:  # cumulative reward is the score so far / 100, each turn
        total += r.reward
        assert total == pytest.approx(r.info["score"] / 100)
    assert [r.info["score"] for r in results] == sorted(r.info["score"] for r in results)
    assert total == pytest.approx(1.0)


def test_an_invalid_action_costs_the_turn_and_shows_valid_actions():
    g = ScienceWorldGame(task="find-plant", max_turns=3)
    g.reset(task="find-plant", variation=sw.variations("find-plant")["test"][1])
    first = g.step("look around")
    bad = g.step("please fetch me a sandwich")
    assert not bad.info["valid"] and bad.reward == 0.0 and not bad.done
    assert bad.info["score"] == first.info["score"] and bad.info["moves"] == first.info["moves"]
    assert "No known action matches" in bad.observation and "look around" in bad.observation
    assert "Some valid actions here: " in bad.observation
    last = g.step("")
    assert last.done and not last.info["valid"]  # max_turns reached


def test_a_failed_task_ends_the_episode_at_score_zero():
    g = ScienceWorldGame(task="find-living-thing")
    g.reset(task="find-living-thing", variation=0)
    gold = gold_actions("find-living-thing", 0)
    results = play(g, gold[:gold.index(next(a for a in gold if a.startswith("focus on")))])
    assert results[-1].info["score"] > 0
    bad = g.step("focus on air")  # air is not a living thing
    assert bad.done and bad.info["failed"] and bad.info["raw_score"] < 0 and bad.info["score"] == 0
    assert sum(r.reward for r in results) + bad.reward == pytest.approx(0.0)


def test_episodes_sharing_one_simulator_replay_to_their_own_state(monkeypatch):
    monkeypatch.setenv(sw.JVMS_ENV, "1")
    monkeypatch.setattr(sw, "_POOL", None)
    actions = ["go to kitchen", "look around", "go to outside", "look around", "pick up blue jay egg", "inventory"]
    alone = ScienceWorldGame(task="find-living-thing")
    alone.reset(task="find-living-thing", variation=0)
    expected = [alone.step(a).observation for a in actions]
    a, b = ScienceWorldGame(task="find-living-thing"), ScienceWorldGame(task="find-animal")
    a.reset(task="find-living-thing", variation=0)
    b.reset(task="find-animal", variation=3)
    got = []
    for act in actions:
        got.append(a.step(act).observation)
        b.step("look around")  # the single simulator now holds b's episode
    assert got == expected
    sw.pool().close()


def test_the_envhost_builds_prompts_and_steps_it():
    state = initial_state(ScienceWorldGame, {"task": "find-plant"}, seed=5, split="test")
    assert state["variation"] in sw.variations("find-plant")["test"]
    game, system, user, tools = open_episode(ScienceWorldGame, {"task": "find-plant"}, state)
    assert "one action command" in system and tools == []
    assert user.startswith("Your task is to find a(n) plant") and "This room is called" in user
    reply = take_step(game, "look around")
    assert reply.info["task"] == "find-plant" and reply.info["valid"] and not reply.done
