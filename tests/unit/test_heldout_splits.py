"""Every built-in env with a "test" split holds its test problems out of training: over
many group seeds no test problem is ever a train problem, the env's own split rule
calls each drawn test problem "test", the test split has at least 200 distinct
problems (or the smaller number its docstring gives, where the task cannot have 200),
and a seed always gives the same problem."""

from __future__ import annotations

import re
import shutil
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from opentinker.services.envhost.envs import arith, bandit, gomoku, guess_number, selfplay, splits
from opentinker.services.envhost.envs.arith import ArithGame
from opentinker.services.envhost.envs.bandit import BanditGame
from opentinker.services.envhost.envs.code_math import CodeMathGame
from opentinker.services.envhost.envs.geometry3k import SAMPLE_DIR, Geometry3kGame
from opentinker.services.envhost.envs.geometry3k import load_split as geometry_split
from opentinker.services.envhost.envs.gomoku import GomokuGame
from opentinker.services.envhost.envs.gsm8k import GSM8KGame, load_split, prepare_gsm8k
from opentinker.services.envhost.envs.guess_number import GuessNumberGame
from opentinker.services.envhost.envs.selfplay import GomokuDuelGame, NegotiationGame
from opentinker.services.envhost.envs.swe import SWEGame
from fixtures.gsm8k_data import SAMPLE as GSM8K_SAMPLE, gsm8k_src

SEEDS = 5000


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory) -> str:
    """GSM8K prepared as Parquet: all of it (7,473 train, 1,319 test) where `GSM8K_SRC`
    names it, else the committed sample (40 train, 20 test; tests/fixtures/gsm8k_data.py)."""
    src = gsm8k_src()
    out = tmp_path_factory.mktemp("gsm8k")
    sizes = prepare_gsm8k(src, out)
    assert sizes == ({"train": 40, "test": 20} if src == GSM8K_SAMPLE else {"train": 7473, "test": 1319})
    return str(out)


@dataclass
class Case:
    """An env configuration: how to make it, what one of its problems is (from the
    state, written here independently of the env), the env's own split of a state
    (None where it has none to ask), and how many distinct test problems to expect:
    `exact` where the docstring gives the number, else at least `least`."""

    make: Callable[[dict[str, Any]], Any]
    problem: Callable[[dict[str, Any], dict[str, Any]], Any]
    split_of: Callable[[dict[str, Any]], str] | None = None
    least: int = 200
    exact: int | None = None


def _product(state: dict[str, Any], _: dict[str, Any]) -> tuple[int, int]:
    a, b = (int(x) for x in re.fullmatch(r"What is (\d+) \* (\d+)\?", state["question"]).groups())
    return min(a, b), max(a, b)


def _gsm8k_question(state: dict[str, Any], args: dict[str, Any]) -> str:
    return load_split(args["data_dir"], state["split"])[0][state["index"]]


def _position(stones: list[list[Any]]) -> frozenset[tuple[int, int, str]]:
    return frozenset((r, c, who) for r, c, who in stones)


def _geometry(state: dict[str, Any], _: dict[str, Any]) -> tuple[str, str, bytes]:
    p = geometry_split(SAMPLE_DIR, state["split"])[state["index"]]
    return p.problem, p.answer, p.images[0].read_bytes()


CASES: dict[str, tuple[dict[str, Any], Case]] = {
    # arith's defaults (1-digit add) pose 55 problems, 8 of them test (arith docstring)
    "arith": ({}, Case(lambda a: ArithGame(**a), lambda s, _: tuple(sorted((s["a"], s["b"]))),
                       lambda s: arith.split_of("add", s["a"], s["b"]), exact=8)),
    "arith-2-digits": ({"digits": 2}, Case(lambda a: ArithGame(**a), lambda s, _: tuple(sorted((s["a"], s["b"]))),
                                           lambda s: arith.split_of("add", s["a"], s["b"]))),
    "code-math-arith": ({"source": "arith"}, Case(lambda a: CodeMathGame(**a), _product,
                                                  lambda s: arith.split_of("mul", *_product(s, {})))),
    # the README's tool-use task: 3-digit x 2-digit products, none of them test for training
    "code-math-3x2": ({"source": "arith", "digits": 3, "digits_b": 2},
                      Case(lambda a: CodeMathGame(**a), _product, lambda s: arith.split_of("mul", *_product(s, {})))),
    "code-math-gsm8k": ({}, Case(lambda a: CodeMathGame(**a), _gsm8k_question)),
    "gsm8k": ({}, Case(lambda a: GSM8KGame(**a), _gsm8k_question)),
    # 16 targets: 3 are test (guess_number docstring)
    "guess-number": ({}, Case(lambda a: GuessNumberGame(**a), lambda s, _: s["target"],
                              lambda s: guess_number.split_of(16, s["target"]), exact=3)),
    "guess-number-1000": ({"n": 1000}, Case(lambda a: GuessNumberGame(**a), lambda s, _: s["target"],
                                            lambda s: guess_number.split_of(1000, s["target"]), exact=200)),
    "guess-number-huge": ({"n": 10**6}, Case(lambda a: GuessNumberGame(**a), lambda s, _: s["target"],
                                             lambda s: guess_number.split_of(10**6, s["target"]))),
    "bandit": ({}, Case(lambda a: BanditGame(**a), lambda s, _: tuple(s["probs"]),
                        lambda s: bandit.split_of(s["probs"]))),
    "gomoku": ({}, Case(lambda a: GomokuGame(**a), lambda s, _: (s["first"], _position(s["stones"]), s["seed"]),
                        gomoku.split_of)),
    "gomoku-opening": ({"opening": 2, "first": "random"},
                       Case(lambda a: GomokuGame(**a), lambda s, _: (s["first"], _position(s["stones"]), s["seed"]),
                            gomoku.split_of)),
    # 600 openings of one stone pair on the 5x5 centre: 200 are test (selfplay docstring)
    "gomoku-duel": ({}, Case(lambda a: GomokuDuelGame(**a), lambda s, _: _position(s["stones"]),
                             lambda s: selfplay.duel_split_of(7, 1, s["stones"]), exact=200)),
    "gomoku-duel-opening-2": ({"opening": 2}, Case(lambda a: GomokuDuelGame(**a), lambda s, _: _position(s["stones"]),
                                                   lambda s: selfplay.duel_split_of(7, 2, s["stones"]))),
    # pots 6..12: only the pot of 9 is test (selfplay docstring)
    "negotiation": ({}, Case(lambda a: NegotiationGame(**a), lambda s, _: s["pot"],
                             lambda s: selfplay.negotiation_held_out().split_of(selfplay.negotiation_key(s["pot"])),
                             exact=1)),
    # the shipped sample: 24 train, 8 test (the full Geometry3K test split has 601)
    "geometry3k": ({"data_dir": str(SAMPLE_DIR)}, Case(lambda a: Geometry3kGame(**a), _geometry, exact=8)),
    # the 40 generated repositories: 8 are test (swe docstring)
    "swe": ({}, Case(lambda a: SWEGame(**a), lambda s, _: s["task"], exact=8)),
}


def _draw(case: Case, args: dict[str, Any], split: str, seeds: range) -> dict[int, dict[str, Any]]:
    game = case.make(args)
    return {s: game.generate_initial_state(s, split) for s in seeds}


@pytest.mark.parametrize("name", list(CASES))
def test_test_problems_are_never_train_problems(name, request):
    args, case = CASES[name]
    if "gsm8k" in name:  # only these need the data
        args = {**args, "data_dir": request.getfixturevalue("gsm8k_dir")}
        n_test = len(load_split(args["data_dir"], "test")[0])
        if n_test < case.least:  # the sample: every one of its test problems is drawn
            case = dataclasses.replace(case, exact=n_test)
    train, test = (_draw(case, args, split, range(SEEDS)) for split in ("train", "test"))
    train_problems = {case.problem(s, args) for s in train.values()}
    test_problems = {case.problem(s, args) for s in test.values()}
    assert not train_problems & test_problems
    if case.split_of is not None:
        assert {case.split_of(s) for s in test.values()} == {"test"}
        assert {case.split_of(s) for s in train.values()} == {"train"}
    if case.exact is not None:
        assert len(test_problems) == case.exact
    else:
        assert len(test_problems) >= case.least
    # determinism: a fresh instance gives every seed the same state again
    for split, states in (("train", train), ("test", test)):
        assert _draw(case, args, split, range(300)) == {s: states[s] for s in range(300)}


def test_gsm8k_splits_share_no_question(gsm8k_dir):
    train, test = (set(load_split(gsm8k_dir, split)[0]) for split in ("train", "test"))
    assert (len(train), len(test)) in ((7473, 1319), (40, 20)) and not train & test


def test_scienceworld_test_variations_are_never_train_variations():
    if shutil.which("java") is None:
        pytest.skip("ScienceWorld needs a Java runtime")
    pytest.importorskip("scienceworld")
    from opentinker.services.envhost.envs import scienceworld as sw

    g = sw.ScienceWorldGame()
    train, test = ({(st["task"], st["variation"]) for st in
                    (g.generate_initial_state(s, split) for s in range(SEEDS))} for split in ("train", "test"))
    assert not train & test
    # ScienceWorld's own split: 75 test variations of each of the 4 default tasks
    assert sum(len(sw.variations(t)["test"]) for t in sw.DEFAULT_TASKS) == 300 and len(test) >= 200
    assert g.generate_initial_state(7, "test") == sw.ScienceWorldGame().generate_initial_state(7, "test")


def test_a_space_of_fewer_than_5_problems_holds_none_out():
    # a fifth of 4 targets is none: the test split asks the train targets
    g = GuessNumberGame(n=4)
    assert splits.held_out_count(4) == 0
    assert {g.generate_initial_state(s, "test")["target"] for s in range(100)} == {1, 2, 3, 4}
    # one problem (fixed probabilities, a fixed pot, no opening) is asked by both splits
    for game, field in ((BanditGame(probs=[0.1, 0.9]), "probs"), (NegotiationGame(pot=10), "pot"),
                        (GomokuDuelGame(opening=0), "stones")):
        assert game.generate_initial_state(3, "test")[field] == game.generate_initial_state(3, "train")[field]


def test_held_out_counts_are_a_fifth_raised_to_200_where_a_third_allows():
    assert [splits.held_out_count(n) for n in (4, 5, 16, 599, 600, 999, 1000, 5000)] == [
        0, 1, 3, 119, 200, 200, 200, 1000]
    held = splits.HeldOut(f"k{i}" for i in range(600))
    assert held.size == 600 and len(held.test) == 200
    assert held.test == splits.HeldOut(f"k{i}" for i in reversed(range(600))).test  # order-free


@pytest.mark.parametrize("make", [ArithGame, GuessNumberGame, BanditGame, GomokuGame, GomokuDuelGame,
                                  NegotiationGame])
def test_an_unknown_split_is_an_error_naming_it(make):
    with pytest.raises(ValueError, match="split: 'validation'"):
        make().generate_initial_state(0, "validation")


def test_an_eval_only_verifiers_env_holds_a_tenth_of_it_out_of_training():
    from opentinker.services.envhost.envs.hub_verifiers import _split_rows

    class EvalOnly:
        def build_dataset(self):
            return None

        def build_eval_dataset(self):
            return list(range(50))

    rows = _split_rows(EvalOnly(), "verifiers:eval-only")
    train, test = set(rows["train"][1]), set(rows["test"][1])
    assert len(test) == 5 and len(train) == 45 and not train & test
