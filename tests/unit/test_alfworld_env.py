"""The alfworld env on ALFWorld data made offline (tests/fixtures/alfworld_games.py:
ALFRED problems turned into game files by the package's own `alfworld-generate`),
loaded by ALFWorld's own code: game choice per seed and split, the expert's
walkthrough wins, invalid commands, the turn limit, and the operator's data setting."""

import gc
import json
import threading
from pathlib import Path

import pytest

from fixtures.alfworld_games import GAMES, shared_alfworld_data
from opentinker.services.envhost.envs import alfworld as alf
from opentinker.services.envhost.envs.alfworld import AlfWorldGame, parse_action
from opentinker.services.envhost.service import initial_state, open_episode

WELCOME = "-= Welcome to TextWorld, ALFRED! =-"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return shared_alfworld_data(tmp_path_factory)  # generated once per run (the integration test's too)


@pytest.fixture(autouse=True)
def alfworld_data(data, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(data))


def walkthrough(data: Path, game: str) -> list[str]:
    return json.loads((data / game).read_text())["walkthrough"]


def test_a_seed_picks_the_same_game_and_splits_keep_their_folders():
    g = AlfWorldGame()
    train = {s: g.generate_initial_state(s, "train")["game"] for s in range(40)}
    test = {s: g.generate_initial_state(s, "test")["game"] for s in range(40)}
    assert train == {s: AlfWorldGame().generate_initial_state(s, "train")["game"] for s in range(40)}
    assert all(p.startswith("json_2.1.1/train/") and p.endswith("/game.tw-pddl") for p in train.values())
    assert all(p.startswith("json_2.1.1/valid_unseen/") for p in test.values())
    n_train = sum(1 for s, *_ in GAMES if s == "train")
    assert len(set(train.values())) == n_train and len(set(test.values())) == len(GAMES) - n_train
    assert g.generate_initial_state(3, "valid_unseen") == {**g.generate_initial_state(3, "test"),
                                                           "split": "valid_unseen"}
    # the envhost's own call: the group's state
    assert initial_state(AlfWorldGame, {}, 7, "train") == {"game": train[7], "split": "train"}
    with pytest.raises(ValueError, match="split: 'dev'"):
        g.generate_initial_state(0, "dev")


def test_task_types_choose_the_games():
    cool = {AlfWorldGame(task_types=[5]).generate_initial_state(s)["game"] for s in range(30)}
    assert cool and all("/pick_cool_then_place_in_recep-" in p for p in cool)
    simple = {AlfWorldGame(task_types=["pick_and_place_simple"]).generate_initial_state(s)["game"]
              for s in range(30)}
    assert len(simple) == 2 and all("/pick_and_place_simple-" in p for p in simple)
    with pytest.raises(ValueError, match="env_args.task_types: 7"):
        AlfWorldGame(task_types=[7])
    with pytest.raises(ValueError, match="env_args.task_types"):
        AlfWorldGame(task_types=[])
    with pytest.raises(FileNotFoundError, match="no solvable game of types look_at_obj_in_light"):
        AlfWorldGame(task_types=[2]).generate_initial_state(0)
    with pytest.raises(ValueError, match="env_args.max_turns"):
        AlfWorldGame(max_turns=0)
    with pytest.raises(ValueError, match="env_args.admissible_commands"):
        AlfWorldGame(admissible_commands="yes")


@pytest.mark.parametrize("split", ["train", "test"])
def test_the_expert_walkthrough_wins_every_game(data, split):
    games = {AlfWorldGame().generate_initial_state(s, split)["game"] for s in range(40)}
    for game in sorted(games):
        env, state = AlfWorldGame(), {"game": game, "split": split}
        _, system, user, _ = open_episode(AlfWorldGame, {}, state)
        assert "one command" in system
        assert WELCOME in user and "Your task is to: " in user and "Admissible commands: " in user
        obs = env.reset(**state)
        assert obs.startswith(WELCOME) and "you see a cabinet 1, a countertop 1, and a fridge 1" in obs
        assert "go to countertop 1" in env.admissible
        steps = walkthrough(data, game)
        for i, cmd in enumerate(steps):
            assert cmd in env.admissible, (game, cmd, env.admissible)
            r = env.step(cmd)
            last = i == len(steps) - 1
            assert (r.reward, r.done, r.info["won"]) == ((1.0, True, True) if last else (0.0, False, False)), \
                (game, cmd, r)
            assert r.info["admissible"] and r.info["command"] == cmd and r.info["game"] == game
        assert r.observation.startswith("You move the ")


def test_a_command_the_game_does_not_know_costs_a_turn_and_changes_nothing():
    env = AlfWorldGame(max_turns=3)
    env.reset(**env.generate_initial_state(0, "train"))
    before = list(env.admissible)
    r = env.step("fly to the moon")
    assert r.observation.startswith(alf.NOTHING) and "Admissible commands: " in r.observation
    assert (r.reward, r.done, r.info["admissible"], r.info["turn"]) == (0.0, False, False, 1)
    assert env.admissible == before
    r = env.step("Action: Go to Countertop 1.\nI think this is right")
    assert r.info["admissible"] and r.observation.startswith("You arrive at countertop 1.")
    r = env.step("")
    # the turn limit ends the episode, unwon, and the game is given back
    assert (r.reward, r.done, r.info["won"], r.info["turn"]) == (0.0, True, False, 3)
    with pytest.raises(RuntimeError, match="not running"):
        env.step("look")


def test_without_admissible_commands_the_observation_is_the_game_text():
    env = AlfWorldGame(admissible_commands=False)
    obs = env.reset(**env.generate_initial_state(1, "test"))
    assert obs.startswith(WELCOME) and obs.rstrip(".").split("Your task is to: ")[1]
    assert "Admissible" not in obs and "Admissible" not in env.step("look").observation


def test_parse_action():
    assert parse_action("> Take  Apple 1 from CounterTop 1.") == "take apple 1 from countertop 1"
    assert parse_action("\n\n`open fridge 1`\nthen more") == "open fridge 1"
    assert parse_action("Action: \"look\"") == "look"
    assert parse_action("") == ""


def test_two_episodes_at_once_keep_their_own_games(data):
    """Episodes in threads, interleaved, each with its own game stack (and Fast
    Downward library); finished stacks are reused."""
    games = sorted({AlfWorldGame().generate_initial_state(s)["game"] for s in range(40)})[:2]
    envs = [AlfWorldGame() for _ in games]
    threads = [threading.Thread(target=e.reset, kwargs={"game": g}) for e, g in zip(envs, games)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    plans = [walkthrough(data, g) for g in games]
    results = [[], []]
    for i in range(max(map(len, plans))):
        for k in (0, 1):
            if i < len(plans[k]):
                results[k].append(envs[k].step(plans[k][i]))
    assert all(r[-1].reward == 1.0 and r[-1].done for r in results)
    assert len(alf._stacks.idle) >= 2
    idle = len(alf._stacks.idle)
    again = AlfWorldGame()
    again.reset(game=games[0])
    assert len(alf._stacks.idle) == idle - 1  # a finished game's stack, not a new one
    # an episode dropped unfinished gives its stack back when collected; TextWorld's
    # global parsers keep the frames of their last call (and so the game) until the next
    del again
    AlfWorldGame().reset(game=games[1])
    gc.collect()
    assert len(alf._stacks.idle) == idle - 1


def test_reset_plays_only_the_operators_games(data):
    env = AlfWorldGame(task_types=[1])
    train_game = env.generate_initial_state(0, "train")["game"]
    for game, split in (("../../etc/passwd", "train"), (train_game, "test"), (str(data / train_game), "train")):
        with pytest.raises(ValueError, match="is not an ALFWorld game of split"):
            env.reset(game=game, split=split)
    cool = AlfWorldGame(task_types=[5]).generate_initial_state(0, "train")["game"]
    with pytest.raises(ValueError, match="is not an ALFWorld game"):
        env.reset(game=cool, split="train")  # outside the job's task types


def test_missing_data_names_the_setting_and_the_download(tmp_path, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError) as e:
        AlfWorldGame().generate_initial_state(0, "train")
    msg = str(e.value)
    assert str(tmp_path / "json_2.1.1" / "train") in msg and "$ALFWORLD_DATA" in msg and "alfworld-download" in msg
    (tmp_path / "json_2.1.1" / "valid_unseen").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no solvable game"):
        AlfWorldGame().generate_initial_state(0, "test")
