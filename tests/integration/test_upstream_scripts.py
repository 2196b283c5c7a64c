"""Upstream OpenTinker's own client scripts and configs, verbatim
(tests/fixtures/upstream_client: math_rl.py, math_inference.py and their hydra YAML),
run as a user of the shared stack (tests/tenants.py) with only a key in the environment:
`opentinker upstream SCRIPT overrides`, laid out as in upstream's checkout
(opentinker/client/ with upstream's own `utils/` beside the scripts, which must not be
what they import) and with GSM8K rows in upstream's Parquet columns under data/."""

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import log_rows
from opentinker.sdk.client import Client
from tests.fixtures.gsm8k_data import SAMPLE as GSM8K
from tests.fixtures.upstream_data import geo3k_rows
from tests.tenants import make_user

pytestmark = pytest.mark.timeout(900)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "upstream_client"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def _upstream_rows(src: Path, n: int, split: str) -> list[dict]:
    """The first `n` GSM8K problems of `src` in the columns upstream's preprocessing
    writes (opentinker/data_preprocess/math_multiturn_w_interaction.py)."""
    rows = []
    for i, line in enumerate(src.read_text().splitlines()[:n]):
        p = json.loads(line)
        question, gold = p["question"] + " " + INSTRUCTION, p["answer"].rsplit("####", 1)[1].strip()
        rows.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": gold},
                     "extra_info": {"split": split, "index": i, "question": p["question"],
                                    "interaction_kwargs": {"name": "math", "query": question, "ground_truth": gold}}})
    return rows


def _checkout(root: Path) -> Path:
    """upstream's layout: opentinker/client/{math_rl.py, math_inference.py, client_config/,
    utils/} and data/math/{train,test}.parquet. Returns the repository root."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    client = root / "opentinker" / "client"
    shutil.copytree(FIXTURE, client, ignore=shutil.ignore_patterns("README.md", "LICENSE", "__pycache__"))
    (client / "utils").mkdir()
    (client / "utils" / "__init__.py").write_text("")
    for name in ("http_training_client", "utils", "scheduler_client_lifecycle"):
        (client / "utils" / f"{name}.py").write_text(f"raise ImportError('upstream utils.{name} was imported')\n")
    data = root / "data" / "math"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(_upstream_rows(GSM8K / "train.jsonl", 8, "train")), data / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_upstream_rows(GSM8K / "test.jsonl", 4, "test")), data / "test.parquet")
    return root


def _user_env(world, key: str, home: Path) -> dict[str, str]:
    """A tenant's environment: the key travels here, never on a command line; the YAML's
    own example key is overridden with null so the client takes $OPENTINKER_API_KEY."""
    return {"PATH": os.environ["PATH"], "HOME": str(home), "NATS_URL": world.server.url, "OPENTINKER_API_KEY": key,
            "OPENTINKER_HOME": os.environ.get("OPENTINKER_HOME", str(home / "h")),
            "TMPDIR": os.environ.get("TMPDIR", "/tmp"), "HYDRA_FULL_ERROR": "1"}


def _run(root: Path, env: dict, script: str, *overrides: str) -> subprocess.CompletedProcess:
    r = subprocess.run([str(Path(sys.executable).parent / "opentinker"), "upstream", f"opentinker/client/{script}",
                        *overrides],
                       capture_output=True, text=True, env=env, cwd=root, timeout=800)
    print(r.stdout[-6000:], r.stderr[-6000:])
    return r


async def _logged(world, job_id: str, n: int, columns: str) -> list[tuple]:
    """`columns` of the episodes the job trained on (the log's `steps`: a job requeued
    once also logged its first attempt's episodes), once `n` are there (conftest.log_rows:
    the recorder writes the log a moment after the job ends)."""
    rows = await log_rows(world.data_dir, f"SELECT count(*) OVER (), {columns} FROM trajectories JOIN steps "
                          f"USING (job_id, step, request_id) WHERE job_id = '{job_id}' AND split = 'train' "
                          "ORDER BY episode_id", n, timeout_s=60)
    return [row[1:] for row in rows]


async def test_upstreams_math_scripts_train_and_infer_unchanged(world, tmp_path):
    key = await make_user(world.api, "erin")
    root = await asyncio.to_thread(_checkout, tmp_path / "OpenTinker")
    env = _user_env(world, key, tmp_path)
    common = [f"scheduler_url={world.api_url}", "scheduler_api_key=null", f"tokenizer_path={world.tiny_model}"]
    r = await asyncio.to_thread(
        _run, root, env, "math_rl.py", *common, "data_path=data/math/train.parquet",
        "val_data_path=data/math/test.parquet", "batch_size=2", "rollout_n=2", "num_steps=2", "test_freq=1",
        "val_batch_size=2", "max_new_tokens=8", "max_prompt_tokens=400", "multi_turn.max_tokens_per_turn=8",
        "logger_backends=[console]", "experiment_name=upstream-math")
    assert r.returncode == 0, r.stderr[-4000:]
    job_id = re.search(r"✓ Job (\S+) allocated at", r.stdout).group(1)
    assert "Training completed! Metrics:" in r.stdout
    assert "upstream utils" not in r.stdout + r.stderr

    erin = await Client.connect(world.server.url, api_key=key, api_url=world.api_url)
    try:
        rec = await erin.job(job_id).record()
        assert (rec.state.value, rec.spec.steps, rec.spec.env, rec.spec.lora_rank) == ("completed", 2, "math", 0), rec
        splits = {(m.split, m.step) async for m in erin.job(job_id).metrics()}
        assert ("train", 1) in splits and any(s == "eval" for s, _ in splits), splits  # test_freq=1

        r = await asyncio.to_thread(
            _run, root, env, "math_inference.py", *common[:2], f"model_path={job_id}",
            "data_path=data/math/test.parquet", "output_path=results.jsonl", "max_samples=2", "max_new_tokens=8")
        assert r.returncode == 0, r.stderr[-4000:]
        inf_id = re.search(r"✓ Inference job (\S+) started at", r.stdout).group(1)
        assert "Total samples: 2" in r.stdout  # GameStatsClient: the episodes played in that process
        rows = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
        assert [row["ground_truth"] for row in rows] == [p["reward_model"]["ground_truth"] for p in
                                                        _upstream_rows(GSM8K / "test.jsonl", 2, "test")]
        assert all(row["messages"][0]["role"] == "system" and "\\boxed{}" in row["messages"][0]["content"]
                   for row in rows)
        # the lifecycle manager ended the inference job when the script exited
        assert (await erin.job(inf_id).record()).state.value == "completed"
    finally:
        await erin.close()


async def test_upstreams_gomoku_script_trains_on_its_game_unchanged(world, tmp_path):
    """gomoku_rl.py and gomoku_param.yaml (its wandb_key nulled: upstream's file carries
    one): the game from opentinker.environment.gomoku, its kwargs from the YAML's
    interaction.config, multi-turn episodes, and the script's closing statistics
    counted from the games served in its own process."""
    key = await make_user(world.api, "gina")
    root = await asyncio.to_thread(_checkout, tmp_path / "OpenTinker")
    env = _user_env(world, key, tmp_path)
    r = await asyncio.to_thread(
        _run, root, env, "gomoku_rl.py", f"scheduler_url={world.api_url}", "scheduler_api_key=null",
        f"tokenizer_path={world.tiny_model}", "batch_size=2", "rollout_n=2", "num_steps=1", "test_freq=1",
        "val_batch_size=2", "max_new_tokens=24", "max_prompt_tokens=400", "multi_turn.max_tokens_per_turn=8",
        "interaction.config.max_total_steps=3", "logger_backends=[console]", "experiment_name=upstream-gomoku")
    assert r.returncode == 0, r.stderr[-4000:]
    job_id = re.search(r"✓ Job (\S+) allocated!", r.stdout).group(1)
    assert "Training completed!" in r.stdout and "upstream utils" not in r.stdout + r.stderr
    games = int(re.search(r"Total games: (\d+)", r.stdout).group(1))
    assert games >= 4, r.stdout[-3000:]  # 1 step of 2 groups of 2, and the evaluations
    gina = await Client.connect(world.server.url, api_key=key, api_url=world.api_url)
    try:
        rec = await gina.job(job_id).record()
        assert (rec.state.value, rec.spec.env, rec.spec.sampling.max_turns) == ("completed", "gomoku", 3), rec
        turns = [m.values["turns_mean"] async for m in gina.job(job_id).metrics() if m.split == "train"]
        assert turns and turns[0] >= 1.0, turns
    finally:
        await gina.close()


async def test_upstreams_math_tool_script_runs_code_in_the_users_sandbox(world, tmp_path):
    """math_tool_rl.py and its YAML: CodeInterpreterMathGame on the rows, its Python run
    by `opentinker sandbox` on this machine (the sandbox URL given to the game as the
    job's env_args, as any game kwarg can be)."""
    key = await make_user(world.api, "hana")
    root = await asyncio.to_thread(_checkout, tmp_path / "OpenTinker")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sandbox = subprocess.Popen([str(Path(sys.executable).parent / "opentinker"), "sandbox", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = _user_env(world, key, tmp_path)
    try:
        r = await asyncio.to_thread(
            _run, root, env, "math_tool_rl.py", f"scheduler_url={world.api_url}", "scheduler_api_key=null",
            f"tokenizer_path={world.tiny_model}", "data_path=data/math/train.parquet", "val_data_path=null",
            "batch_size=2", "rollout_n=2", "num_steps=1", "max_new_tokens=24", "max_prompt_tokens=400",
            "multi_turn.max_tokens_per_turn=8", "logger_backends=[console]", "experiment_name=upstream-tool",
            f"+job_spec.env_args.sandbox_url='http://127.0.0.1:{port}/run_code'")
    finally:
        sandbox.terminate()
        sandbox.wait(10)
    assert r.returncode == 0, r.stderr[-4000:]
    job_id = re.search(r"✓ Job (\S+) allocated at", r.stdout).group(1)
    hana = await Client.connect(world.server.url, api_key=key, api_url=world.api_url)
    try:
        rec = await hana.job(job_id).record()
        assert (rec.state.value, rec.spec.env) == ("completed", "math_code_interpreter"), rec
        assert rec.spec.env_args == {"sandbox_url": f"http://127.0.0.1:{port}/run_code"}
    finally:
        await hana.close()


async def test_upstreams_geo3k_script_trains_a_vision_language_model_on_its_rows(world, tmp_path, tiny_vlm):
    """geo3k_rl.py and geo3k_param.yaml (its wandb_key nulled) on Parquet rows in
    upstream's Geo3K columns (the shipped diagrams as `images`), a tiny LLaVA: each
    episode is shown its row's diagram, logged by hash."""
    key = await make_user(world.api, "iris")
    root = await asyncio.to_thread(_checkout, tmp_path / "OpenTinker")
    (root / "data" / "geo3k").mkdir(parents=True)
    await asyncio.to_thread(geo3k_rows, root / "data" / "geo3k" / "train.parquet", 4)
    r = await asyncio.to_thread(
        _run, root, _user_env(world, key, tmp_path), "geo3k_rl.py", f"scheduler_url={world.api_url}",
        "scheduler_api_key=null", f"tokenizer_path={tiny_vlm}", "val_data_path=null", "batch_size=2",
        "rollout_n=2", "num_steps=1", "max_new_tokens=6", "max_prompt_tokens=900",
        "multi_turn.max_tokens_per_turn=6", "logger_backends=[console]", "experiment_name=upstream-geo3k")
    assert r.returncode == 0, r.stderr[-4000:]
    job_id = re.search(r"✓ Job (\S+) allocated at", r.stdout).group(1)
    iris = await Client.connect(world.server.url, api_key=key, api_url=world.api_url)
    try:
        rec = await iris.job(job_id).record()
        assert (rec.state.value, rec.spec.env, rec.spec.model) == ("completed", "geo3k", tiny_vlm), rec
    finally:
        await iris.close()
    rows = await _logged(world, job_id, 4, "len(image_sha256)")
    assert rows == [(1,)] * 4, rows


async def test_upstreams_geo3k_tool_script_gives_feedback_between_attempts(world, tmp_path, tiny_vlm):
    """geo3k_tool_rl.py and geo3k_tool_param.yaml (its wandb_key nulled; it imports
    opentinker.client.utils.* by absolute path): Geo3KToolEnvironment on the rows, so
    each episode is up to max_assistant_turns - 1 boxed attempts with verl's feedback
    between them, the figure shown in the first."""
    key = await make_user(world.api, "jade")
    root = await asyncio.to_thread(_checkout, tmp_path / "OpenTinker")
    (root / "data" / "geo3k_multiturn").mkdir(parents=True)
    await asyncio.to_thread(geo3k_rows, root / "data" / "geo3k_multiturn" / "train.parquet", 4)
    r = await asyncio.to_thread(
        _run, root, _user_env(world, key, tmp_path), "geo3k_tool_rl.py", f"scheduler_url={world.api_url}",
        f"tokenizer_path={tiny_vlm}", "val_data_path=null", "batch_size=2", "rollout_n=2", "num_steps=1",
        "max_new_tokens=24", "max_prompt_tokens=900", "multi_turn.max_assistant_turns=3",
        "multi_turn.max_tokens_per_turn=6", "logger_backends=[console]", "experiment_name=upstream-geo3k-tool")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Max retries: 2" in r.stdout
    job_id = re.search(r"✓ Job (\S+) allocated at", r.stdout).group(1)
    jade = await Client.connect(world.server.url, api_key=key, api_url=world.api_url)
    try:
        rec = await jade.job(job_id).record()
        assert (rec.state.value, rec.spec.env, rec.spec.model) == ("completed", "geo3k_tool", tiny_vlm), rec
        assert rec.spec.sampling.max_turns == 3, rec.spec.sampling
    finally:
        await jade.close()
    rows = await _logged(world, job_id, 4, "num_turns, [t.observation FOR t IN turns], len(image_sha256)")
    # a random model boxes nothing: two attempts, the first answered with verl's feedback
    assert all(turns == 2 and images == 1 for turns, _, images in rows), rows
    assert all(obs[0] == "Current parsed answer=(no boxed answer) reward=0.0" for _, obs, _ in rows), rows


async def test_upstreams_inference_scripts_play_their_games_unchanged(world, tmp_path):
    """gomoku_inference.py (games made by the game itself, no data) and
    math_tool_inference.py (rows, CodeInterpreterMathGame at upstream's default
    sandbox URL: with no sandbox there, each code block gets the error as its
    observation), each against a served base model, with their YAML files."""
    key = await make_user(world.api, "kate")
    root = await asyncio.to_thread(_checkout, tmp_path / "OpenTinker")
    env = _user_env(world, key, tmp_path)
    common = [f"scheduler_url={world.api_url}", "scheduler_api_key=null", f"model_path={world.tiny_model}"]
    r = await asyncio.to_thread(
        _run, root, env, "gomoku_inference.py", *common, "output_path=gomoku.jsonl", "max_samples=2",
        "max_new_tokens=24", "multi_turn.max_tokens_per_turn=8", "multi_turn.max_assistant_turns=3",
        "board_size=7")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Total samples: 2" in r.stdout, r.stdout[-3000:]
    games = [json.loads(line) for line in (root / "gomoku.jsonl").read_text().splitlines()]
    assert len(games) == 2 and all("on a 7x7 board" in g["messages"][0]["content"] for g in games), games[0]

    r = await asyncio.to_thread(
        _run, root, env, "math_tool_inference.py", *common, "data_path=data/math/test.parquet",
        "output_path=tool.jsonl", "max_samples=2", "max_new_tokens=16", "max_tokens_per_turn=8")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Total samples: 2" in r.stdout, r.stdout[-3000:]
    rows = [json.loads(line) for line in (root / "tool.jsonl").read_text().splitlines()]
    assert [row["ground_truth"] for row in rows] == [p["reward_model"]["ground_truth"] for p in
                                                    _upstream_rows(GSM8K / "test.jsonl", 2, "test")]
    assert all("using Python code" in row["messages"][0]["content"] for row in rows), rows[0]["messages"][0]


async def test_upstreams_alfworld_script_trains_on_alfworld_games(world, tmp_path, tmp_path_factory):
    """alfworld_rl.py and alfworld_param.yaml (its wandb_key nulled): upstream's
    ALFWorldGame on ALFWorld games made offline (tests/fixtures/alfworld_games.py), in
    the user's process with ALFWORLD_DATA set there: multi-turn episodes of commands,
    and the script's closing statistics counted from them."""
    from fixtures.alfworld_games import shared_alfworld_data

    data = await asyncio.to_thread(shared_alfworld_data, tmp_path_factory)
    key = await make_user(world.api, "lena")
    root = await asyncio.to_thread(_checkout, tmp_path / "OpenTinker")
    r = await asyncio.to_thread(
        _run, root, {**_user_env(world, key, tmp_path), "ALFWORLD_DATA": str(data)}, "alfworld_rl.py",
        f"scheduler_url={world.api_url}", "scheduler_api_key=null", f"tokenizer_path={world.tiny_model}",
        "batch_size=2", "rollout_n=2", "num_steps=1", "test_freq=1", "val_batch_size=2", "max_new_tokens=24",
        "max_prompt_tokens=600", "multi_turn.max_tokens_per_turn=8", "interaction.config.max_total_steps=3",
        "logger_backends=[console]", "experiment_name=upstream-alfworld")
    assert r.returncode == 0, r.stderr[-4000:]
    job_id = re.search(r"✓ Job (\S+) allocated!", r.stdout).group(1)
    episodes = int(re.search(r"Total episodes: (\d+)", r.stdout).group(1))
    assert episodes >= 4, r.stdout[-3000:]  # 1 step of 2 groups of 2, and the evaluations
    lena = await Client.connect(world.server.url, api_key=key, api_url=world.api_url)
    try:
        rec = await lena.job(job_id).record()
        assert (rec.state.value, rec.spec.env, rec.spec.sampling.max_turns) == ("completed", "alfworld", 3), rec
    finally:
        await lena.close()
    rows = await _logged(world, job_id, 4, "num_turns, [t.observation FOR t IN turns]")
    assert len(rows) == 4 and all(1 <= n <= 3 for n, _ in rows), rows
    assert all(o.startswith(("=== Current State ===", "TIMEOUT")) for _, obs in rows for o in obs if o), rows
