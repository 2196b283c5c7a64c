"""Vision-language envs: images through the envhost, and the geometry3k envs."""

import io
import json
import random
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw

from opentinker.environment import images as I
from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.schemas import EnvResetRequest, EnvStepRequest
from opentinker.services.envhost.envs.geometry3k import (
    SAMPLE_DIR,
    Geometry3kGame,
    Geometry3kToolGame,
    answer_value,
    calculate,
    grade,
    load_split,
    parse_action,
    read_split,
)
from opentinker.services.envhost.registry import BUILTIN
from opentinker.services.envhost.service import EnvHost


def diagram(label: str, fmt: str = "PNG") -> bytes:
    """A small picture with `label` drawn on it, as file bytes."""
    img = Image.new("RGB", (64, 48), "white")
    ImageDraw.Draw(img).text((8, 16), label, fill="black")
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def pixels(data: bytes) -> bytes:
    return I.decode_image(data).tobytes()


ROWS = {  # split -> [(problem, answer)]
    "train": [("<image>Find x.", "5"), ("<image>Find y.", "2\\sqrt{3}"), ("<image>Find z.", "14.5")],
    "test": [("<image>Find the area.", "36")],
}


def write_parquet(root):
    (root / "data").mkdir(parents=True)
    for split, rows in ROWS.items():
        table = pa.table({"problem": [p for p, _ in rows], "answer": [a for _, a in rows],
                          "images": [[{"bytes": diagram(a), "path": None}] for _, a in rows]})
        # HF's shard naming under data/ for train, a plain <split>.parquet for test
        pq.write_table(table, root / "data" / "train-00000-of-00001.parquet" if split == "train"
                       else root / "test.parquet")


def write_jsonl(root):
    (root / "img").mkdir(parents=True)
    for split, rows in ROWS.items():
        with open(root / f"{split}.jsonl", "w") as f:
            for n, (p, a) in enumerate(rows):
                (root / "img" / f"{split}{n}.png").write_bytes(diagram(a))
                f.write(json.dumps({"problem": p, "answer": a, "images": [f"img/{split}{n}.png"]}) + "\n")


def write_intergps(root):
    for split, rows in ROWS.items():
        for n, (p, a) in enumerate(rows):
            d = root / split / str(n if split == "train" else 2401 + n)
            d.mkdir(parents=True)
            choices = ["1", "2", a, "99"]
            (d / "data.json").write_text(json.dumps({"problem_text": p.replace("<image>", ""),
                                                     "choices": choices, "answer": "C", "id": n}))
            (d / "img_diagram.png").write_bytes(diagram(a))


@pytest.mark.parametrize("write", [write_parquet, write_jsonl, write_intergps])
def test_each_data_layout_loads_problems_answers_and_diagrams(tmp_path, write):
    write(tmp_path)
    for split, rows in ROWS.items():
        problems = read_split(tmp_path, split)
        assert [(p.answer) for p in problems] == [a for _, a in rows]
        for prob, (text, answer) in zip(problems, rows):
            g = Geometry3kGame(data_dir=str(tmp_path))
            g.reset(index=problems.index(prob), split=split)
            assert g.get_initial_user_message() == text.replace("<image>", "").strip()
            [img] = I.check_images(g.get_initial_images())
            assert pixels(img) == pixels(diagram(answer))
            assert g.step(f"\\boxed{{{answer}}}").reward == 1.0


def test_missing_split_and_bad_rows_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no 'train' split"):
        read_split(tmp_path, "train")
    (tmp_path / "train.jsonl").write_text('{"problem": "<image>Find x.", "answer": "1"}\n')
    with pytest.raises(ValueError, match="train.jsonl:1: a row needs problem, answer and images"):
        read_split(tmp_path, "train")
    with pytest.raises(ValueError, match="env_args.split"):
        Geometry3kGame(split="dev")


def test_shipped_sample_seeds_are_deterministic_and_splits_disjoint():
    train, test = load_split(SAMPLE_DIR, "train"), load_split(SAMPLE_DIR, "test")
    assert (len(train), len(test)) == (24, 8)
    def key(p):
        return p.problem, p.answer, p.images[0].read_bytes()

    assert not {key(p) for p in train} & {key(p) for p in test}
    assert all(answer_value(p.answer) is not None for p in train + test)  # exact, gradable answers
    g = Geometry3kGame()
    states = {s: g.generate_initial_state(seed=s, split="test") for s in range(40)}
    assert states == {s: Geometry3kGame().generate_initial_state(seed=s, split="test") for s in range(40)}
    assert {st["index"] for st in states.values()} == set(range(8))  # every test problem is drawn
    assert all(st["split"] == "test" for st in states.values())
    assert Geometry3kGame(split="train").generate_initial_state(seed=3, split="test")["split"] == "train"


def test_shipped_diagrams_are_small_pngs():
    for split in ("train", "test"):
        for p in load_split(SAMPLE_DIR, split):
            data = p.images[0].read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 16_000
            assert I.decode_image(data).size == (224, 224)


@pytest.mark.parametrize("reply, gold, correct", [
    ("x is 5, so \\boxed{5}", "5", True),
    ("\\boxed{5.0}", "5", True),
    ("\\boxed{4}", "5", False),
    ("5", "5", False),  # no \boxed{}
    ("\\boxed{3.46}", "2\\sqrt{3}", True),  # within 1%
    ("\\boxed{3.3}", "2\\sqrt{3}", False),
    ("\\boxed{2\\sqrt{3}}", "3.46", True),
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", True),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "0.866", True),
    ("\\boxed{\\dfrac{29}{2}}", "14.5", True),
    ("\\boxed{10\\pi}", "31.42", True),
    ("\\boxed{31.4}", "10\\pi", True),
    ("\\boxed{60^\\circ}", "60", True),
    ("\\boxed{x = 7}", "7", True),
    ("\\boxed{12 \\text{ cm}}", "12", True),
    ("first \\boxed{3} then \\boxed{4}", "4", True),  # the last one counts
    ("\\boxed{AB}", "ab", True),  # not numbers: normalized text
    ("\\boxed{AC}", "AB", False),
])
def test_grading(reply, gold, correct):
    assert grade(reply, gold)[0] is correct


def test_step_reward_and_info():
    g = Geometry3kGame()
    g.reset(index=0, split="train")
    gold = g.problem.answer
    r = g.step(f"Thinking... \\boxed{{{gold}}}")
    assert (r.reward, r.done, r.info["correct"], r.info["parsed"]) == (1.0, True, True, gold)
    r = g.step("\\boxed{-1}")
    assert (r.reward, r.done, r.info["correct"]) == (0.0, True, False)


@pytest.mark.parametrize("expr, value", [
    ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("2 ** 10", 1024), ("2^10", 1024), ("7 % 4", 3),
    ("sqrt(3**2 + 4**2)", 5), ("2 * pi * 3", 18.84955592153876), ("sin(radians(30))", 0.5),
    ("math.sqrt(2)", 2 ** 0.5), ("-e", -2.718281828459045), ("10 / 4", 2.5),
])
def test_calculator_values(expr, value):
    assert calculate(expr) == pytest.approx(value)


@pytest.mark.parametrize("expr, why", [
    ("__import__('os')", "only the functions"),
    ("open('/etc/passwd').read()", "only the functions"),
    ("(1).__class__", "not allowed"),
    ("x + 1", "unknown name 'x'"),
    ("9 ** 9 ** 9", "exponent"),
    ("10 ** 400", "too large"),
    ("2 ** 1001", "exponent"),
    ("1 / 0", "division by zero"),
    ("sqrt(-1)", "domain"),
    ("'a' * 3", "not a number"),
    ("1 +" * 300 + "1", "characters"),
    ("[1, 2]", "not allowed"),
    ("lambda: 1", "not allowed"),
])
def test_calculator_refuses(expr, why):
    with pytest.raises(ValueError, match=why):
        calculate(expr)


def test_tool_call_parsing():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "sqrt(2)"}}</tool_call>'
    assert parse_action(f"Let me compute. {call}") == (["sqrt(2)"], None, [])
    as_string = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    assert parse_action(as_string)[0] == ["1+1"]
    assert parse_action("```calc\n2*3\n4+5\n```")[0] == ["2*3", "4+5"]
    assert parse_action("```python\nimport math\nprint(math.sqrt(2))  # root\n```")[0] == ["math.sqrt(2)"]
    exprs, final, errors = parse_action('<tool_call>{"name": "python", "arguments": {}}</tool_call>')
    assert exprs == [] and final is None and "unknown tool 'python'" in errors[0]
    assert "not valid JSON" in parse_action("<tool_call>{oops</tool_call>")[2][0]
    # a \boxed{} inside a tool call is not an answer; one outside it is
    assert parse_action('<tool_call>{"name": "calculator", "arguments": {"expression": "\\\\boxed{1}"}}'
                        '</tool_call>')[1] is None
    assert parse_action(f"{call} so \\boxed{{3}}")[1] is not None


def test_tool_env_turns():
    g = Geometry3kToolGame()
    assert [t["function"]["name"] for t in g.get_tools()] == ["calculator"]
    g.reset(**g.generate_initial_state(seed=0, split="test"))
    r = g.step('<tool_call>{"name": "calculator", "arguments": {"expression": "sqrt(3**2 + 4**2)"}}</tool_call>')
    assert (r.observation, r.reward, r.done) == ("sqrt(3**2 + 4**2) = 5", 0.0, False)
    r = g.step("```calc\n__import__('os')\n```")
    assert "error: only the functions" in r.observation and not r.done
    r = g.step("I am not sure.")
    assert "\\boxed{}" in r.observation and "calculator" in r.observation and not r.done
    r = g.step('<tool_call>{"name": "shell"}</tool_call>')
    assert "unknown tool 'shell'" in r.observation and not r.done
    r = g.step(f"So \\boxed{{{g.problem.answer}}}")
    assert (r.reward, r.done, r.info["correct"], r.info["tool_calls"]) == (1.0, True, True, 2)


def test_registered():
    assert BUILTIN["geometry3k"] is Geometry3kGame and BUILTIN["geometry3k-tool"] is Geometry3kToolGame


# ---- images through the envhost --------------------------------------------------

async def test_reset_reply_carries_the_diagram_as_png():
    host = EnvHost({n: BUILTIN[n] for n in ("geometry3k", "geometry3k-tool")}, "h", max_concurrency=2,
                   episode_ttl_s=60)
    for name in ("geometry3k", "geometry3k-tool"):
        state = {"index": 2, "split": "train"}
        r = await host.reset(name, EnvResetRequest(env=name, episode_id="e", state=state), None)
        assert r.error == "" and len(r.images) == 1 and r.images[0][:4] == b"\x89PNG"
        path = load_split(SAMPLE_DIR, "train")[2].images[0]
        assert pixels(r.images[0]) == pixels(path.read_bytes())
        assert "<image>" not in r.user_message and r.user_message
        assert bool(r.tools) is (name == "geometry3k-tool")
        step = await host.step(EnvStepRequest(episode_id="e", action="\\boxed{0}"), None)
        assert step.done and step.reward == 0.0 and step.images == [] and step.error == ""
    host.shutdown()


def noise_png(side: int) -> bytes:
    """A PNG of random pixels: it does not compress (about 3 * side**2 bytes)."""
    img = Image.frombytes("RGB", (side, side), random.Random(0).randbytes(3 * side * side))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


BAD_IMAGES = {  # what the env shows -> the error (a regex)
    "undecodable": ([b"\x89PNG not really an image"], r"images\[0\]: not a readable image"),
    "truncated": ([diagram("ok"), diagram("cut")[:60]], r"images\[1\]: .*does not decode"),
    "too many": ([diagram(str(i)) for i in range(I.MAX_IMAGES + 1)], r"images: 9 images .* limit of 8"),
    "too large": ([noise_png(1024)], r"images\[0\]: \d+ bytes encoded is over the limit of 2097152"),
    "too many pixels": ([Image.new("1", (4097, 4096))], r"images\[0\]: 4097x4096 .* over the limit"),
    "not an image": ([{"an": "image"}], r"images\[0\]: an image is a PIL.Image.Image, bytes or a file path"),
    "missing file": (["/nonexistent/diagram.png"], r"FileNotFoundError: images\[0\]: .*/nonexistent/diagram.png"),
    "not a list": ("diagram.png", r"images: must be a list"),
}


class PictureGame(AbstractGame):
    """Shows `first` with the first message and `then` with its one step's observation."""

    first: object = ()
    then: object = ()

    def reset(self, **state):
        return "Look."

    def get_initial_images(self):
        return self.first

    def step(self, action):
        return StepResult("Look again.", 0.0, False, images=self.then)


@pytest.mark.parametrize("case", list(BAD_IMAGES))
async def test_bad_images_from_a_user_env_become_the_replys_error(case):
    images, why = BAD_IMAGES[case]
    opening = type("Opening", (PictureGame,), {"first": images})
    later = type("Later", (PictureGame,), {"first": [diagram("fine")], "then": images})
    host = EnvHost({"opening": opening, "later": later}, "h", max_concurrency=2, episode_ttl_s=60)
    r = await host.reset("opening", EnvResetRequest(env="opening", episode_id="a"), None)
    assert r.host_id == "" and r.images == []
    assert re.search(why, r.error), r.error
    assert ("", "a") not in host.episodes
    r = await host.reset("later", EnvResetRequest(env="later", episode_id="b"), None)
    assert r.error == "" and len(r.images) == 1
    step = await host.step(EnvStepRequest(episode_id="b", action="hi"), None)
    assert step.done and re.search(why, step.error), step.error
    assert ("", "b") not in host.episodes  # the episode ended; the host goes on
    host.shutdown()


def test_image_forms_are_encoded_once_and_in_order(tmp_path):
    jpeg, gif = diagram("j", "JPEG"), diagram("g", "GIF")
    path = tmp_path / "d.png"
    path.write_bytes(diagram("p"))
    pic = Image.new("CMYK", (10, 10))
    out = I.check_images([jpeg, gif, str(path), path, pic])
    assert out[0] == jpeg  # PNG and JPEG pass through unchanged
    assert out[1][:4] == b"\x89PNG" and pixels(out[1]) == pixels(gif)  # others become PNG
    assert out[2] == out[3] == path.read_bytes()
    assert I.decode_image(out[4]).size == (10, 10) and I.decode_image(out[4]).mode == "RGB"
    assert I.check_images(None) == [] and I.check_images(()) == []
    with pytest.raises(ValueError, match="not a readable image"):
        I.decode_image(b"junk")
