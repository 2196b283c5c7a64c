"""The game envs (gomoku, bandit) and the GSM8K answer verifier: what a user would see."""

import threading

import pytest

from opentinker.services.envhost.envs import answers
from opentinker.services.envhost.envs.answers import verify_answer
from opentinker.services.envhost.envs.bandit import BanditGame
from opentinker.services.envhost.envs.gomoku import (
    DIRECTIONS,
    GomokuGame,
    opponent_move,
    parse_move,
    render,
    wins_at,
)


def stones(*cells, who="X"):
    """[row, column, who] from names like "C4" (row 4 is index 3)."""
    return [[int(c[1:]) - 1, ord(c[0]) - ord("A"), who] for c in cells]


# ---- gomoku --------------------------------------------------------------------------

@pytest.mark.parametrize("dr, dc", DIRECTIONS)
def test_gomoku_win_is_detected_in_every_direction(dr, dc):
    board = [["."] * 9 for _ in range(9)]
    start_c = 6 if dc < 0 else 2  # the anti-diagonal runs leftwards
    line = [(2 + k * dr, start_c + k * dc) for k in range(5)]
    for r, c in line[:4]:
        board[r][c] = "X"
    last = line[4]
    assert wins_at(board, *last, "X", 5)
    assert not wins_at(board, *last, "O", 5)
    board[line[1][0]][line[1][1]] = "O"  # a broken line is no win
    assert not wins_at(board, *last, "X", 5)


def test_gomoku_model_wins_and_gets_the_win_reward():
    g = GomokuGame(size=9, opponent="random")
    g.reset(seed=0, stones=stones("A1", "B1", "C1", "D1") + stones("A9", "B9", "C9", "D8", who="O"))
    r = g.step("E1")
    assert (r.reward, r.done, r.info["result"]) == (1.0, True, "win")
    assert "You win" in r.observation and r.info["moves"] == ["E1"]


def test_gomoku_renders_letters_numbers_and_the_move_format():
    g = GomokuGame(size=5, win_length=4)
    g.reset(seed=0, stones=stones("C2") + stones("B3", who="O"))
    text = g.get_initial_user_message()
    assert render(g.board).splitlines() == [
        "   A B C D E",
        " 1 . . . . .",
        " 2 . . X . .",
        " 3 . O . . .",
        " 4 . . . . .",
        " 5 . . . . .",
    ]
    assert render(g.board) in text and "C3" in text and "4 in a row" in text
    assert "5x5" in g.get_system_prompt() and "A-E" in g.get_system_prompt()
    assert render([["."] * 19 for _ in range(19)]).splitlines()[-1].startswith("19 .")


@pytest.mark.parametrize("text, want", [
    ("E5", (4, 4)), ("e5", (4, 4)), ("I'll play d3 now.", (2, 3)), ("**Move: C4**", (3, 2)),
    ("A1 or B2", (0, 0)), ("(I9)", (8, 8)),
])
def test_gomoku_parses_the_first_move_token(text, want):
    assert parse_move(text, 9) == want


@pytest.mark.parametrize("text, reason", [
    ("no idea", "no move like E5"), ("", "no move like E5"), ("J1", "J1 is off the 9x9 board"),
    ("A10", "A10 is off"), ("A0", "A0 is off"), ("E123", "no move"),
])
def test_gomoku_unreadable_or_offboard_moves_say_why(text, reason):
    assert reason in parse_move(text, 9)


def test_gomoku_illegal_retry_penalises_then_loses_at_max_illegal():
    g = GomokuGame(size=9, max_illegal=3, illegal_penalty=-0.1)
    g.reset(seed=0, stones=stones("E5"))
    first = g.step("pass")
    assert (first.reward, first.done, first.info["illegal"]) == (-0.1, False, 1)
    assert "Try again" in first.observation and "no move like" in first.info["illegal_reason"]
    taken = g.step("E5")
    assert (taken.reward, taken.done) == (-0.1, False) and "already taken" in taken.observation
    ok = g.step("A1")  # a legal move in between does not reset the count
    assert ok.reward == 0.0 and not ok.done and ok.info["illegal"] == 2
    last = g.step("Z1")
    assert last.done and last.info["result"] == "loss" and last.info["illegal"] == 3
    assert last.reward == pytest.approx(-0.1 - 1.0)


def test_gomoku_legal_reward_lands_on_each_legal_move_and_adds_to_the_outcome():
    g = GomokuGame(size=9, opponent="random", legal_reward=0.1)
    g.reset(seed=0, stones=stones("E5"))
    assert g.step("pass").reward == -0.1  # an illegal move earns none
    assert g.step("A1").reward == pytest.approx(0.1)
    g.reset(seed=0, stones=stones("A1", "B1", "C1", "D1") + stones("A9", "B9", "C9", "D8", who="O"))
    win = g.step("E1")
    assert win.info["result"] == "win" and win.reward == pytest.approx(1.1)
    with pytest.raises(ValueError, match="env_args.legal_reward"):
        GomokuGame(legal_reward=float("nan"))


def test_gomoku_illegal_loss_ends_at_once():
    g = GomokuGame(illegal="loss", loss_reward=-2.0)
    g.reset(seed=0)
    r = g.step("I pass")
    assert (r.reward, r.done, r.info["result"]) == (-2.0, True, "loss")
    with pytest.raises(RuntimeError, match="over"):
        g.step("E5")


def test_gomoku_draw_when_the_board_fills():
    # 5x5, five in a row: a full board with columns in XXOOX / OOXXO stripes has none.
    rows = ["XXOOX", "OOXXO", "XXOOX", "OOXXO", "XXOO."]
    full = [[r, c, v] for r, row in enumerate(rows) for c, v in enumerate(row) if v != "."]
    g = GomokuGame(size=5, draw_reward=0.25)
    g.reset(seed=0, stones=full)
    r = g.step("E5")
    assert (r.reward, r.done, r.info["result"]) == (0.25, True, "draw")
    assert "draw" in r.observation


@pytest.mark.parametrize("level", ["greedy", "strong"])
def test_gomoku_opponent_blocks_a_four_and_takes_a_win(level):
    import random

    board = [["."] * 9 for _ in range(9)]
    for c in range(1, 5):  # X on B5..E5, both ends open: O must block
        board[4][c] = "X"
    assert opponent_move(board, level, 5, random.Random(0)) in {(4, 0), (4, 5)}
    for r in range(4):  # O now has A1..A4 and can win at A5
        board[r][0] = "O"
    assert opponent_move(board, level, 5, random.Random(0)) == (4, 0)


def test_gomoku_strong_blocks_an_open_three():
    import random

    board = [["."] * 9 for _ in range(9)]
    for c in (3, 4, 5):  # X on D5..F5: an open four next move unless O blocks
        board[4][c] = "X"
    board[0][0] = "O"
    assert opponent_move(board, "strong", 5, random.Random(0)) in {(4, 2), (4, 6), (4, 1), (4, 7)}


def test_gomoku_episode_is_deterministic_for_a_seed():
    def play(seed):
        g = GomokuGame(opponent="greedy", first="random", opening=2)
        state = g.generate_initial_state(seed)
        g.reset(**state)
        out = [g.get_initial_user_message()]
        for move in ("E5", "D4", "F6", "C3", "G7"):
            r = g.step(move)
            out.append((r.observation, r.reward, r.done))
            if r.done:
                break
        return state, out

    assert play(3) == play(3)
    states = [play(s)[0] for s in range(20)]
    assert len({str(s["stones"]) for s in states}) > 1
    assert {s["first"] for s in states} == {"model", "opponent"}


def test_gomoku_random_opponent_is_seeded_by_the_state():
    def replies(seed):
        g = GomokuGame(opponent="random")
        g.reset(seed=seed)
        return g.step("A1").info["moves"]
    assert replies(1) == replies(1)
    assert len({tuple(replies(s)) for s in range(10)}) > 1


def test_gomoku_bad_env_args_name_the_field():
    for kwargs, field in [({"size": 4}, "size"), ({"size": 20}, "size"),
                          ({"win_length": 10}, "win_length"), ({"opponent": "perfect"}, "opponent"),
                          ({"illegal": "ignore"}, "illegal"), ({"first": "X"}, "first"),
                          ({"win_reward": "big"}, "win_reward"), ({"opening": 5}, "opening")]:
        with pytest.raises(ValueError, match=f"env_args.{field}"):
            GomokuGame(**kwargs)
    with pytest.raises(ValueError, match="stones"):
        GomokuGame().reset(stones=[[0, 0, "X"], [0, 0, "O"]])


# ---- bandit --------------------------------------------------------------------------

def test_bandit_probs_are_drawn_per_seed_and_deterministic():
    g = BanditGame(arms=5)
    a, b = g.generate_initial_state(seed=1), BanditGame(arms=5).generate_initial_state(seed=1)
    assert a == b and len(a["probs"]) == 5 and all(0 <= p <= 1 for p in a["probs"])
    assert a != g.generate_initial_state(seed=2)


def test_bandit_expected_mode_pays_the_probability():
    g = BanditGame(probs=[0.2, 0.7, 0.5], reward_mode="expected", show_probs=True)
    g.reset(**g.generate_initial_state(seed=0))
    assert "Arm 2: pays with probability 0.70" in g.get_initial_user_message()
    r = g.step("I pull arm 3.")
    assert (r.reward, r.done) == (0.5, True)
    assert r.info["chosen"] == 3 and r.info["best"] == 2
    assert r.info["regret"] == pytest.approx(0.2)


def test_bandit_fixed_probs_sample_bernoulli_rewards():
    g = BanditGame(probs=[0.0, 1.0])
    g.reset(**g.generate_initial_state(seed=9))
    prompt = g.get_initial_user_message()
    assert "numbered 1 to 2" in prompt and "1.00" not in prompt
    assert [g.step(a).reward for a in ("1", "2", "2", "1")] == [0.0, 1.0, 1.0, 0.0]
    half = BanditGame(probs=[0.5, 0.5])
    half.reset(probs=[0.5, 0.5])
    assert {half.step("1").reward for _ in range(200)} == {0.0, 1.0}


@pytest.mark.parametrize("reply, error", [
    ("the best one", "no arm number"), ("5", "5 is not an arm"), ("1.5", "1.5 is not an arm"),
    ("0", "0 is not an arm"),
])
def test_bandit_unparseable_choice_gets_zero(reply, error):
    g = BanditGame(probs=[0.9, 0.9, 0.9, 0.9], reward_mode="expected")
    g.reset(probs=[0.9, 0.9, 0.9, 0.9])
    r = g.step(reply)
    assert (r.reward, r.done, r.info["valid"], r.info["chosen"]) == (0.0, True, False, None)
    assert error in r.info["error"]


def test_bandit_bad_env_args_name_the_field():
    for kwargs, field in [({"arms": 1}, "arms"), ({"arms": 27}, "arms"),
                          ({"probs": [1.5, 0.1]}, "probs"), ({"probs": [0.5]}, "probs"),
                          ({"arms": 3, "probs": [0.1, 0.2]}, "arms"),
                          ({"reward_mode": "mean"}, "reward_mode"),
                          ({"show_probs": "yes"}, "show_probs")]:
        with pytest.raises(ValueError, match=f"env_args.{field}"):
            BanditGame(**kwargs)


# ---- the math answer verifier ----------------------------------------------------------

@pytest.mark.parametrize("reply, gold, correct, read", [
    ("72", "72", True, "72"),
    ("She sold 48 + 24 = 72 clips in all.\n#### 72", "72", True, "72"),
    ("#### 1,200", "1200", True, "1200"),
    ("Each day she makes $18.", "18", True, "18"),
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", True, "\\frac{1}{2}"),
    ("3 + 4 = 7", "7", True, "7"),
    ("#### 72.00", "72", True, "72.00"),
    ("#### 18\nI hope this helps! 3", "18", True, "18"),
    ("#### 73", "72", False, "73"),
    ("72 clips? No: 48 + 24 = 70", "72", False, "70"),
    ("I don't know", "72", False, ""),
    ("", "72", False, ""),
])
def test_verify_answer(reply, gold, correct, read):
    assert verify_answer(reply, gold) == (correct, read)


def test_verify_answer_works_from_worker_threads():
    got: list[tuple[bool, str]] = []
    def check(i: int) -> None:
        got.append(verify_answer(f"#### {i},000", f"{i}000"))

    threads = [threading.Thread(target=check, args=(i,)) for i in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [(True, f"{i}000") for i in range(1, 5)]


def test_verify_answer_a_runaway_check_is_cut_off(monkeypatch):
    # Math-Verify's own alarm stops this one after VERIFY_TIMEOUT_S; a deadline below
    # that makes the parent kill the child instead, and the next check starts a new one.
    verify_answer("1", "1")  # a warm child, so the deadline does not cover its start
    monkeypatch.setattr(answers, "CHECK_DEADLINE_S", 1.0)
    assert verify_answer("$10^{10^{10}}$", "5") == (False, "<timeout>")
    monkeypatch.setattr(answers, "CHECK_DEADLINE_S", 30.0)
    assert verify_answer("#### 5", "5") == (True, "5")
