"""OpenTinker's environment interface, as its users write it: the import path, served
names, both forms of generate_initial_state (deterministic per group seed), and the
first user message from the prompt hooks."""

import importlib
import random
import sys
from pathlib import Path

import pytest

from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.services.envhost.loader import EnvLoadError, env_name, load_envs
from opentinker.services.envhost.service import initial_state, open_episode

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "seed_envs.py"


@pytest.fixture(scope="module")
def seed_envs():
    return load_envs([f"{FIXTURE}:NimGame", f"{FIXTURE}:SumGame"])


def test_one_api_at_openTinkers_import_path():
    import opentinker.environment as env_pkg
    import opentinker.sdk as sdk
    from opentinker.services.envhost import service

    assert env_pkg.AbstractGame is sdk.AbstractGame is service.AbstractGame is AbstractGame
    assert env_pkg.StepResult is sdk.StepResult is StepResult
    assert importlib.util.find_spec("opentinker.schemas.game") is None  # no second copy


def test_served_names_follow_get_interaction_name(seed_envs):
    assert set(seed_envs) == {"nim", "seed_sum"}  # class name without "game"; the override

    class Game(AbstractGame):
        pass

    class NeedsArgsGame(AbstractGame):
        def __init__(self, size):
            self.label = f"board{size}"

        def get_interaction_name(self) -> str:
            return self.label  # set in __init__: neither instance can answer

    class SpacedGame(AbstractGame):
        def get_interaction_name(self) -> str:
            return "two words"

    class NamedGame(AbstractGame):
        name = "named-one"

    with pytest.raises(EnvLoadError, match="no env name"):
        env_name(Game)
    with pytest.raises(EnvLoadError, match="get_interaction_name.*failed.*pass --name"):
        env_name(NeedsArgsGame)
    assert env_name(NeedsArgsGame, "board") == "board"
    with pytest.raises(EnvLoadError, match="must match"):
        env_name(SpacedGame)
    assert env_name(NamedGame) == "named-one"


def test_argument_free_generate_initial_state_is_seeded_per_group(seed_envs):
    nim = seed_envs["nim"]
    states = [initial_state(nim, {"max_pile": 30}, seed, "train") for seed in range(20)]
    assert states == [initial_state(nim, {"max_pile": 30}, seed, "train") for seed in range(20)]
    assert len({s["pile"] for s in states}) > 5 and all(4 <= s["pile"] <= 30 for s in states)
    # as OpenTinker's generator: random.seed(seed), then the call
    random.seed(7)
    expected = random.randint(4, 9)
    assert initial_state(nim, {}, 7, "train") == {"pile": expected}


def test_seeded_form_gets_seed_and_split():
    seen = []

    class SeededGame(AbstractGame):
        def generate_initial_state(self, seed, split="train"):
            seen.append((seed, split))
            return {"x": seed}

    class SeedOnlyGame(AbstractGame):
        def generate_initial_state(self, seed):
            return {"x": seed * 2}

    class BadStateGame(AbstractGame):
        def generate_initial_state(self):
            return [1, 2]

    assert initial_state(SeededGame, {}, 5, "test") == {"x": 5} and seen == [(5, "test")]
    assert initial_state(SeedOnlyGame, {}, 5, "test") == {"x": 10}
    with pytest.raises(TypeError, match="must return a dict"):
        initial_state(BadStateGame, {}, 0, "train")


def test_first_user_message_from_the_prompt_hooks(seed_envs):
    # default rendering: the initial user message, a blank line, reset's observation
    game, system, user, tools = open_episode(seed_envs["nim"], {}, {"pile": 6})
    assert user == "Your move.\n\nThere are 6 stones in the pile." and system.startswith("You are playing Nim")
    assert tools == [] and game.get_state() == {"pile": 6}
    # an override of get_user_message_with_state is the first user message
    game, _, user, _ = open_episode(seed_envs["seed_sum"], {}, {"a": 3, "b": 4})
    assert user == "What is 3 + 4?" and game.step("7").reward == 1.0

    class RenderGame(AbstractGame):
        def reset(self, level=1, **kwargs):
            return "reset text"

        def get_initial_user_message(self):
            return "Start."

        def render_state_for_prompt(self, level=1, **state):
            return f"Level {level}."

    assert open_episode(RenderGame, {}, {"level": 3})[2] == "Start.\n\nLevel 3."

    class ObservationOnlyGame(AbstractGame):
        def reset(self, **kwargs):
            return "Only the observation."

    assert open_episode(ObservationOnlyGame, {}, {})[2] == "Only the observation."


def test_fixture_file_knows_nothing_of_the_project_internals():
    text = FIXTURE.read_text()
    imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
    assert [i for i in imports if "opentinker" in i] == [
        "from opentinker.environment.base_game import AbstractGame, StepResult"]
    assert "name =" not in text and "def generate_initial_state(self)" in text
    assert sys.modules.get("opentinker.schemas.game") is None
