"""Upstream OpenTinker's ALFWorldGame (opentinker.environment.alfworld) on ALFWorld data
made offline (tests/fixtures/alfworld_games.py), played against upstream's own class
(tests/fixtures/upstream_client/environment/alfworld_game.py, verbatim) command for
command, and its environments reused across episodes."""

import gc
import json
import random
from pathlib import Path

import pytest

from fixtures.alfworld_games import shared_alfworld_data
from fixtures.upstream_data import upstream_class
from opentinker.environment.alfworld import ALFWorldGame
from opentinker.environment.alfworld import alfworld_game as alf
from opentinker.environment.base_game import opening


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return shared_alfworld_data(tmp_path_factory)


@pytest.fixture(autouse=True)
def alfworld_data(data, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(data))


def _replies(walkthrough: list[str], rng: random.Random) -> list[str]:
    """The expert's commands in upstream's formats (tagged, or the reply's last line),
    with commands the game cannot do and free text mixed in."""
    out = []
    for cmd in walkthrough:
        kind = rng.random()
        if kind < 0.2:
            out.append("<thinking>hmm</thinking>\nI will jump on the table")
        elif kind < 0.3:
            out.append("look")
        out.append(f"<thinking>next</thinking><action> {cmd} </action>" if rng.random() < 0.6
                   else f"Plan: step.\n{cmd}")
    return out


@pytest.mark.parametrize("split,max_steps", [("train", 20), ("eval_out_of_distribution", 20), ("train", 3)])
def test_alfworld_game_plays_exactly_as_upstreams(split, max_steps):
    """Same seeds, same replies: the first message, every observation, reward, done flag,
    info and state equal upstream's, through wins, invalid commands and timeouts."""
    Upstream = upstream_class("alfworld_game", "ALFWorldGame")
    outcomes = set()
    for seed in range(8):
        ours, theirs = ALFWorldGame(max_steps=max_steps, split=split), Upstream(max_steps=max_steps, split=split)
        assert ours._get_cached_game_paths() == theirs._get_cached_game_paths()
        random.seed(seed)
        state = ours.generate_initial_state()
        random.seed(seed)
        assert theirs.generate_initial_state() == state
        for method in ("get_system_prompt", "get_interaction_name"):
            assert getattr(ours, method)() == getattr(theirs, method)()
        assert ours.get_user_message_with_state(**state) == theirs.get_user_message_with_state(**state)
        assert ours.get_initial_user_message() == theirs.get_initial_user_message()
        assert ours.reset(**state) == theirs.reset(**state)
        game = random.Random(state["seed"]).choice(ours._get_cached_game_paths())
        plan = json.loads((Path(game) / "game.tw-pddl").read_text())["walkthrough"]
        ended = None
        for action in _replies(plan, random.Random(seed)) + ["look"]:  # the last after the end
            a, b = ours.step(action), theirs.step(action)
            assert (a.observation, a.reward, a.done, a.info) == (b.observation, b.reward, b.done, b.info), action
            assert ours.get_state() == theirs.get_state()
            if a.done and ended is None:
                ended = a.reward
        outcomes.add(ended)
        ours.close()
    assert outcomes == ({-1.0} if max_steps == 3 else {10.0}), outcomes


def test_finished_episodes_hand_their_environment_to_the_next():
    """One environment serves episode after episode (a new one each would keep another
    copy of Fast Downward's library); two episodes at once have two."""
    gc.collect()  # episodes other tests dropped give theirs back first
    alf._envs.idle.clear()
    seen = set()
    for seed in range(4):
        game = ALFWorldGame()
        game.reset(seed=seed)
        seen.add(id(game._env))
        game.step("look")
        game.close()
        game.close()  # once
    assert len(seen) == 1 and len(alf._envs.idle) == 1
    a, b = ALFWorldGame(), ALFWorldGame()
    a.reset(seed=0)
    b.reset(seed=1)
    assert a._env is not b._env
    del a  # dropped without close(): its environment goes back when collected
    gc.collect()
    assert len(alf._envs.idle) == 1
    b.close()
    assert len(alf._envs.idle) == 2


def test_served_from_a_game_environment_the_first_message_shows_the_room():
    from opentinker.environment.base_game_environment import GameEnvironment

    env = GameEnvironment(ALFWorldGame, {"batch_size": 2}, game_kwargs={"max_steps": 5, "split": "train"},
                          job_id="alf")
    assert (env.interaction_name, env.has_data) == ("alfworld", False)
    game = env.served_class()
    random.seed(3)
    system, user = opening(game, game.generate_initial_state())
    assert system.startswith("You are an AI assistant playing ALFWorld") and user.startswith("Task: Your task is to:")
    assert "=== Available Actions ===\n- go to cabinet 1" in user and user.endswith("What would you like to do?")
    game.close()


def test_no_games_names_the_data_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"No games found for split='train'.*set ALFWORLD_DATA"):
        ALFWorldGame().reset(seed=0)


def test_the_repository_data_folder_is_where_the_script_started(data, tmp_path, monkeypatch):
    """Without ALFWORLD_DATA, ./alfworld_data of the folder the script was started in
    (hydra runs it from outputs/<date>/<time>/), as upstream's checkout-local folder."""
    import shutil

    from opentinker.client.utils import utils

    started = tmp_path / "OpenTinker"
    shutil.copytree(data, started / "alfworld_data")
    (started / "outputs" / "run").mkdir(parents=True)
    monkeypatch.chdir(started / "outputs" / "run")
    monkeypatch.delenv("ALFWORLD_DATA")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(utils, "launch_dir", lambda: str(started))  # hydra's get_original_cwd()
    assert alf.data_root() == str(started / "alfworld_data")
    assert ALFWorldGame().reset(seed=0).startswith("=== Current State ===\n-= Welcome to TextWorld, ALFRED! =-")
