"""`code-math`: a model that runs Python in the sandbox and then answers is rewarded
for a right answer; the formats, the code-run budget and bad env_args behave as a user
would expect."""

import itertools
import json
import time

import pytest

from opentinker.services.envhost.envs.arith import split_of
from opentinker.services.envhost.envs.code_math import CodeMathGame, parse_action
from opentinker.services.envhost.envs.gsm8k import prepare_gsm8k
from fixtures.gsm8k_data import SAMPLE as GSM8K_SAMPLE



def tool_call(code: str) -> str:
    return f'<tool_call>\n{json.dumps({"name": "python", "arguments": {"code": code}})}\n</tool_call>'


def game(seed=5, split="train", **env_args) -> CodeMathGame:
    g = CodeMathGame(source="arith", **env_args)
    g.reset(**g.generate_initial_state(seed, split))
    return g


def product_code(g: CodeMathGame) -> str:
    a, b = g.get_initial_user_message().removeprefix("What is ").removesuffix("?").split(" * ")
    return f"print({a} * {b})"


def test_a_tool_call_then_the_answer_is_rewarded():
    g = game()
    r = g.step("I will compute it.\n" + tool_call(product_code(g)))
    assert (r.observation, r.reward, r.done) == (f"{g.answer}\n", 0.0, False)
    assert r.info["tool_calls"] == 1 and r.info["exit_code"] == 0
    r = g.step(f"The product is {int(g.answer):,}.\n#### {int(g.answer):,}")
    assert (r.reward, r.done) == (1.0, True)
    assert r.info == {"tool_calls": 1, "exit_code": 0, "timed_out": False, "answer": g.answer,
                      "parsed": g.answer, "correct": True, "ended": "answer"}


def test_a_fenced_block_runs_and_a_boxed_answer_counts():
    g = game()
    r = g.step(f"Let me check:\n```python\n{product_code(g)}\n```")
    assert r.observation == f"{g.answer}\n" and not r.done
    assert g.step(f"So the answer is $\\boxed{{{g.answer}}}$.").reward == 1.0


def test_a_wrong_answer_ends_with_zero():
    g = game()
    r = g.step(f"#### {int(g.answer) + 1}")
    assert (r.reward, r.done, r.info["correct"]) == (0.0, True, False)


def test_a_reply_with_neither_code_nor_answer_is_told_the_format():
    g = game()
    r = g.step("I think it is large.")
    assert not r.done and r.reward == 0.0 and "'#### <number>'" in r.observation
    r = g.step('<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>')
    assert not r.done and "unknown tool 'shell'" in r.observation and g.tool_calls == 0


def test_an_error_in_the_code_is_shown_to_the_model():
    r = game().step(tool_call("print(1 / 0)"))
    assert not r.done and "ZeroDivisionError" in r.observation and r.info["exit_code"] == 1


def test_code_runs_past_max_tool_calls_end_the_episode():
    g = game(max_tool_calls=2)
    assert "last code run" not in g.step(tool_call("print(1)")).observation
    assert "last code run" in g.step("```\nprint(2)\n```").observation
    r = g.step(tool_call("print(3)"))
    assert (r.reward, r.done) == (0.0, True) and "max_tool_calls" in r.info["ended"]
    assert r.info["tool_calls"] == 2


def test_an_infinite_loop_returns_within_the_timeout():
    g = game(timeout_s=1)
    t0 = time.monotonic()
    r = g.step(tool_call("while True: pass"))
    assert time.monotonic() - t0 < 2.5
    assert not r.done and r.info["timed_out"] and "timed out after 1 s" in r.observation
    assert g.step(f"#### {g.answer}").reward == 1.0


def test_a_final_answer_wins_over_code_and_marks_inside_code_do_not_count():
    assert parse_action("```python\nprint('#### 1')\n```") == ("print('#### 1')\n", None, "")
    code, final, _ = parse_action(tool_call("print(2)") + "\n#### 2")
    assert code == "print(2)" and final.strip() == "#### 2"
    g = game()
    r = g.step(tool_call(product_code(g)) + f"\n#### {g.answer}")
    assert r.done and r.reward == 1.0 and g.tool_calls == 0


def test_initial_state_is_deterministic_and_respects_the_split():
    g = CodeMathGame(source="arith")
    assert g.generate_initial_state(3, "train") == g.generate_initial_state(3, "train")
    for split in ("train", "test"):
        for seed in range(10):
            s = g.generate_initial_state(seed, split)
            a, b = map(int, s["question"].removeprefix("What is ").removesuffix("?").split(" * "))
            assert 100 <= a <= 999 and 100 <= b <= 999 and int(s["answer"]) == a * b
            assert split_of("mul", a, b) == split
    assert g.generate_initial_state(3, "train") != g.generate_initial_state(3, "test")


def test_tools_and_prompt_describe_both_formats():
    g = game()
    (tool,) = g.get_tools()
    assert tool["function"]["name"] == "python"
    assert tool["function"]["parameters"]["required"] == ["code"]
    prompt = g.get_system_prompt()
    assert "```python" in prompt and "`python` tool" in prompt and "#### <number>" in prompt
    assert "Example" not in prompt
    shown = CodeMathGame(source="arith", example=True).get_system_prompt()
    assert shown.startswith(prompt) and "print(1.5 * 2.5)" in shown and shown.endswith("#### 3.75")


@pytest.mark.parametrize("env_args, field", [
    ({"max_tool_calls": -1}, "env_args.max_tool_calls"), ({"timeout_s": 0}, "env_args.timeout_s"),
    ({"memory_mb": 8}, "env_args.memory_mb"), ({"source": "math"}, "env_args.source"),
    ({"digits": 0}, "env_args.digits"), ({"split": "dev"}, "env_args.split"),
    ({"digits_b": 10}, "env_args.digits_b"), ({"digits_b": True}, "env_args.digits_b"),
    ({"example": "yes"}, "env_args.example"),
    # upper bounds: a tenant's env_args never size a sandbox beyond these
    ({"memory_mb": 8193}, "env_args.memory_mb"), ({"memory_mb": 2**40}, "env_args.memory_mb"),
    ({"timeout_s": 61}, "env_args.timeout_s"), ({"timeout_s": float("nan")}, "env_args.timeout_s"),
    ({"timeout_s": float("inf")}, "env_args.timeout_s"), ({"max_tool_calls": 1025}, "env_args.max_tool_calls"),
])
def test_bad_env_args_name_the_arg(env_args, field):
    with pytest.raises(ValueError, match=field):
        CodeMathGame(**env_args)


@pytest.mark.parametrize("split", ["train", "test"])
def test_factors_have_digits_and_digits_b_digits(split):
    """The README's tool-use task, 3-digit x 2-digit: a product the model cannot do in its head."""
    for seed in range(50):
        g = game(seed, split, digits=3, digits_b=2)
        a, b = g.get_initial_user_message().removeprefix("What is ").removesuffix("?").split(" * ")
        assert (len(a), len(b)) == (3, 2) and int(g.answer) == int(a) * int(b)


def test_largest_env_args_are_accepted():
    g = CodeMathGame(source="arith", memory_mb=8192, timeout_s=60, max_tool_calls=1024)
    assert g.limits.memory_mb == 8192 and g.max_tool_calls == 1024


@pytest.fixture
def gsm8k_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "test"):
        with open(GSM8K_SAMPLE / f"{split}.jsonl") as f:
            (src / f"{split}.jsonl").write_text("".join(itertools.islice(f, 5)))
    prepare_gsm8k(src, tmp_path / "gsm8k")
    return tmp_path / "gsm8k"


def test_gsm8k_problems_from_both_splits(gsm8k_dir):
    g = CodeMathGame(data_dir=str(gsm8k_dir))
    for split in ("train", "test"):
        state = g.generate_initial_state(2, split)
        assert state["split"] == split and 0 <= state["index"] < 5
        g.reset(**state)
        with open(GSM8K_SAMPLE / f"{split}.jsonl") as f:
            row = json.loads(next(itertools.islice(f, state["index"], None)))
        assert g.get_initial_user_message() == row["question"]
        final = row["answer"].rsplit("####", 1)[1].strip()
        assert g.step(f"#### {final}").reward == 1.0
