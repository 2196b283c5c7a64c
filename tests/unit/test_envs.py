"""The built-in environments: rewards a user would agree with, held-out splits, data prep."""

import itertools
import json

import pyarrow.parquet as pq
import pytest

from opentinker.services.envhost.envs.arith import ArithGame
from opentinker.services.envhost.envs.gsm8k import GSM8KGame, prepare_gsm8k
from opentinker.services.envhost.envs.guess_number import GuessNumberGame
from opentinker.services.envhost.registry import BUILTIN
from fixtures.gsm8k_data import SAMPLE as GSM8K_SAMPLE



def play(game, state, action):
    game.reset(**state)
    return game.step(action)


def test_registry_names_every_builtin():
    assert set(BUILTIN) == {"arith", "gsm8k", "guess-number", "code-math", "gomoku", "bandit", "gomoku-duel",
                            "geometry3k", "geometry3k-tool",
                            "negotiation", "scienceworld", "alfworld", "android-world", "simulated-user", "swe"}


@pytest.mark.parametrize("reply, reward", [
    ("8", 1.0), (" 8.", 1.0), ("The answer is 8", 1.0), ("8\n\nBecause 3 plus 5 is 8.", 1.0),
    ("9", 0.0), ("3 + 5 = 8", 0.0), ("", 0.0), ("eight", 0.0), ("80", 0.0),
])
def test_arith_addition_reward_reads_the_first_number(reply, reward):
    g = ArithGame()
    g.reset(a=3, b=5)
    assert g.get_initial_user_message() == "What is 3 + 5? Reply with only the number."
    r = g.step(reply)
    assert (r.reward, r.done) == (reward, True)


def test_arith_mul_and_max():
    assert play(ArithGame(op="mul"), {"a": 7, "b": 6}, "42").reward == 1.0
    assert play(ArithGame(op="mul"), {"a": 7, "b": 6}, "13").reward == 0.0
    g = ArithGame(op="max")
    assert play(g, {"a": 2, "b": 9}, "9").reward == 1.0
    assert "larger" in g.get_initial_user_message()
    assert play(ArithGame(op="max"), {"a": 2, "b": 9}, "2").reward == 0.0


def test_arith_heldout_split_is_disjoint_and_deterministic():
    g = ArithGame()
    def problems(split):
        return {tuple(sorted(g.generate_initial_state(seed=s, split=split).values()))
                for s in range(2000)}
    train, test = problems("train"), problems("test")
    assert train and test and not (train & test)
    # every single-digit sum is in exactly one split, and both splits are seen
    assert len(train | test) == len(set(itertools.combinations_with_replacement(range(10), 2)))
    assert g.generate_initial_state(seed=5) == ArithGame().generate_initial_state(seed=5)


def test_arith_operands_follow_digits():
    g = ArithGame(digits=2, digits_b=1)
    for s in range(50):
        st = g.generate_initial_state(seed=s)
        assert 10 <= st["a"] <= 99 and 0 <= st["b"] <= 9


def test_arith_bad_env_args_name_the_field():
    with pytest.raises(ValueError, match="op"):
        ArithGame(op="div")
    with pytest.raises(ValueError, match="digits"):
        ArithGame(digits=0)
    with pytest.raises(TypeError, match="opp"):
        ArithGame(opp="add")


@pytest.fixture
def gsm8k_dir(tmp_path):
    """GSM8K's first 20 train and 5 test problems, prepared as Parquet."""
    src = tmp_path / "src"
    src.mkdir()
    for split, n in (("train", 20), ("test", 5)):
        with open(GSM8K_SAMPLE / f"{split}.jsonl") as f:
            (src / f"{split}.jsonl").write_text("".join(itertools.islice(f, n)))
    out = tmp_path / "gsm8k"
    assert prepare_gsm8k(src, out) == {"train": 20, "test": 5}
    return out


def test_gsm8k_prepare_writes_question_answer_final(gsm8k_dir):
    t = pq.read_table(gsm8k_dir / "train.parquet")
    assert t.column_names == ["question", "answer", "final"] and t.num_rows == 20
    first = json.loads((GSM8K_SAMPLE / "train.jsonl").open().readline())
    assert t.column("question")[0].as_py() == first["question"]
    assert t.column("final")[0].as_py() == "72"  # Natalia's clips


def test_gsm8k_prepare_rejects_a_record_without_final_answer(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "no mark"}) + "\n")
    with pytest.raises(ValueError, match="train.jsonl:1"):
        prepare_gsm8k(tmp_path, tmp_path / "out")


def test_gsm8k_reward_on_the_final_number(gsm8k_dir):
    g = GSM8KGame(data_dir=str(gsm8k_dir))
    state = g.generate_initial_state(seed=3, split="test")
    assert state == GSM8KGame(data_dir=str(gsm8k_dir)).generate_initial_state(seed=3, split="test")
    assert 0 <= state["index"] < 5 and state["split"] == "test"
    g.reset(index=0, split="train")
    assert g.get_initial_user_message().startswith("Natalia sold clips")
    assert "####" in g.get_system_prompt()
    for reply, reward in [("48/2 = 24 in May, so 48 + 24 = 72.\n#### 72", 1.0),
                          ("She sold 72 clips.", 1.0), ("#### 72.00", 1.0), ("#### 73", 0.0),
                          ("72 clips? No: 48 + 24 = 70", 0.0), ("I don't know", 0.0)]:
        g.reset(index=0, split="train")
        assert g.step(reply).reward == reward, reply


def test_gsm8k_missing_data_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="opentinker data gsm8k"):
        GSM8KGame(data_dir=str(tmp_path)).generate_initial_state(seed=0)


def test_guess_number_feedback_sequence():
    g = GuessNumberGame(n=16, max_turns=6)
    g.reset(target=11)
    assert "between 1 and 16" in g.get_initial_user_message()
    seq = [g.step(a) for a in ("8", "14", "a guess", "11")]
    assert [r.observation.split(".")[0] for r in seq] == ["Higher", "Lower", "Not a number", "Correct!"]
    assert [r.reward for r in seq] == [0.0, 0.0, 0.0, 1.0]
    assert [r.done for r in seq] == [False, False, False, True]


def test_guess_number_runs_out_of_turns():
    g = GuessNumberGame(n=16, max_turns=2)
    g.reset(target=5)
    assert not g.step("1").done
    last = g.step("2")
    assert last.done and last.reward == 0.0 and "was 5" in last.observation


def test_guess_number_targets_cover_the_range():
    g = GuessNumberGame(n=4)
    assert {g.generate_initial_state(seed=s)["target"] for s in range(100)} == {1, 2, 3, 4}
