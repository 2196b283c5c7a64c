"""Upstream OpenTinker's client API on this service, without a server: its config keys
as our JobSpec, a dataset env's rows on the client, the served game class, the job
`fit` submits, and `run_inference` against a small OpenAI-compatible HTTP server this
test starts (the model stand-in; no engine is under test here)."""

import argparse
import json
import re
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pathlib import Path

import pytest

from opentinker.client.utils.config import ALL_LINEAR, ConfigError, env_name, job_spec_from_config
from opentinker.client.utils.http_training_client import (
    HTTPTrainingClient, SchedulerClient, ServiceClient, plan_job,
)
from opentinker.environment.base_game import AbstractGame, StepResult
from opentinker.environment.base_game_environment import GameEnvironment
from opentinker.environment.inference_pipeline import forget_endpoint, register_endpoint, run_inference
from opentinker.schemas.job import JOB_ID_RE, SpecError
from opentinker.services.envhost.service import initial_state, open_episode, take_step

# upstream's math_param.yaml and gomoku_param.yaml, keys as written there
MATH = {
    "project_name": "opentinker", "experiment_name": "math_training", "logger_backends": ["console", "wandb"],
    "enable_tracing": True, "weave_project": None, "wandb_key": None, "tokenizer_path": "Qwen/Qwen2.5-1.5B",
    "data_path": "data/train.parquet", "val_data_path": None, "batch_size": 64, "num_workers": 0, "num_epochs": 10,
    "num_steps": None, "save_freq": 100, "test_freq": 50, "val_batch_size": 100, "temperature": 0.7, "top_p": 1,
    "max_new_tokens": 4098, "max_prompt_tokens": 4096, "algorithm": "agent_loop", "adv_estimator": "grpo",
    "rollout_n": 16,
    "lora": {"lora_rank": 0, "lora_alpha": 16, "target_modules": "all-linear", "exclude_modules": None,
             "lora_adapter_path": None},
    "interaction": {"name": "math", "class_path": "opentinker.environment.gym_environment_interaction."
                    "GymEnvironmentInteraction",
                    "config": {"env_host": "0.0.0.0", "env_port": 8088, "env_endpoint": "http://0.0.0.0:8088",
                               "max_steps": 1}},
    "multi_turn": {"max_user_turns": 0, "max_assistant_turns": 1, "max_tokens_per_turn": 4096,
                   "weave_project": None, "experiment_name": "math_interaction"},
    "scheduler_url": "http://0.0.0.0:8780", "scheduler_api_key": "otk_x", "num_gpus": 4,
}
GOMOKU = {
    "tokenizer_path": "Qwen/Qwen2.5-3B-Instruct", "batch_size": 4, "num_steps": 1000, "save_freq": 20000,
    "test_freq": 10, "temperature": 1, "top_p": 1, "max_new_tokens": 8192, "max_prompt_tokens": 4096,
    "adv_estimator": "grpo_per_step", "rollout_n": 16,
    "interaction": {"name": "gomoku", "config": {"max_steps": 81, "max_total_steps": 39, "board_size": 9,
                                                 "observation_template": "{observation}"}},
    "multi_turn": {"max_user_turns": 39, "max_assistant_turns": 39, "max_tokens_per_turn": 256},
}


def test_upstream_math_config_maps_each_key_to_its_job_spec_field():
    spec, ignored = job_spec_from_config(MATH)
    assert (spec.model, spec.name, spec.env) == ("Qwen/Qwen2.5-1.5B", "math_training", "math")
    assert (spec.prompts_per_step, spec.group_size, spec.checkpoint_every, spec.eval_every, spec.eval_episodes) == \
        (64, 16, 100, 50, 100)
    assert (spec.sampling.temperature, spec.sampling.top_p) == (0.7, 1)
    # per turn: min(max_tokens_per_turn, max_new_tokens); the episode: prompt + response budget
    assert (spec.sampling.max_new_tokens, spec.sampling.max_total_tokens, spec.sampling.max_turns) == \
        (4096, 4096 + 4098, 1)
    assert (spec.advantage_estimator, spec.advantage) == ("grpo", "episode")
    assert (spec.lora_rank, spec.lr) == (0, 1e-6)  # no LoRA: every parameter, at upstream's actor lr
    for key in ("num_gpus", "scheduler_url", "data_path", "num_epochs", "interaction.config.env_port",
                "interaction.class_path", "algorithm", "multi_turn.experiment_name", "lora.lora_alpha"):
        assert ignored[key], key


def test_gomoku_turns_and_per_step_advantage(caplog):
    with caplog.at_level("INFO", logger="opentinker.client"):
        spec, ignored = job_spec_from_config(GOMOKU)
    # one line a reason: the env server's keys together
    lines = [r.getMessage() for r in caplog.records if "interaction.config.board_size" in r.getMessage()]
    assert len(lines) == 1 and "`interaction.config.max_total_steps`" in lines[0], lines
    assert (spec.advantage, spec.sampling.max_turns, spec.sampling.max_new_tokens) == ("turn", 39, 256)
    assert spec.sampling.max_total_tokens == 4096 + 8192 and spec.steps == 1000 and spec.env == "gomoku"
    assert "game_kwargs" in ignored["interaction.config.board_size"]  # the env server's kwargs: the game's here


def test_lora_section_maps_rank_alpha_all_linear_and_lr():
    spec, _ = job_spec_from_config({"lora": {"lora_rank": 64, "lora_alpha": 32, "target_modules": "all-linear",
                                             "lr": 3e-5}})
    assert (spec.lora_rank, spec.lora_alpha, spec.lora_target_modules, spec.lr) == (64, 32, ALL_LINEAR, 3e-5)
    spec, _ = job_spec_from_config({"lora": {"lora_rank": 8, "target_modules": ["q_proj", "v_proj"]}})
    assert (spec.lora_target_modules, spec.lr) == (["q_proj", "v_proj"], 1e-6)


def test_kl_section_maps_to_the_kl_term():
    spec, _ = job_spec_from_config({"kl": {"use_kl_loss": True, "kl_loss_coef": 0.01, "kl_loss_type": "low_var_kl"}})
    assert (spec.kl_coef, spec.kl_estimator, spec.kl_in_reward) == (0.01, "k3", False)
    spec, _ = job_spec_from_config({"kl": {"use_kl_in_reward": True, "kl_loss_coef": 0.02}})
    assert (spec.kl_coef, spec.kl_in_reward) == (0.02, True)


def test_job_spec_section_sets_any_field_last():
    spec, _ = job_spec_from_config({"lora": {"lora_rank": 8}, "job_spec": {"lr": 1e-3, "sampling": {"max_turns": 3}}})
    assert (spec.lr, spec.sampling.max_turns) == (1e-3, 3)


@pytest.mark.parametrize("config, key", [
    ({"adv_estimator": "ppo_magic"}, "adv_estimator"),
    ({"lora": {"lora_rank": 8, "exclude_modules": ["lm_head"]}}, "lora.exclude_modules"),
    ({"lora": {"lora_rank": 8, "lora_adapter_path": "/x"}}, "lora.lora_adapter_path"),
    ({"reward": {"type": "code"}}, "reward"),
    ({"algorithm": "sft"}, "algorithm"),
    ({"batch_size": 2.5}, "batch_size"),
])
def test_a_key_the_service_cannot_honour_is_refused_by_name(config, key):
    with pytest.raises(ConfigError) as e:
        job_spec_from_config(config)
    assert e.value.key == key and f"`{key}`" in str(e.value)


def test_an_out_of_bounds_value_names_the_field_and_the_upstream_key():
    with pytest.raises(SpecError) as e:
        job_spec_from_config({"rollout_n": 1})
    assert e.value.field == "group_size" and "rollout_n" in str(e.value)
    with pytest.raises(SpecError, match="sampling.top_p"):
        job_spec_from_config({"top_p": 0.9})  # a GRPO training job samples the full distribution


def test_namespaces_map_like_a_dict():
    ns = argparse.Namespace(**{**GOMOKU, "interaction": types.SimpleNamespace(
        name="gomoku", config=types.SimpleNamespace(**GOMOKU["interaction"]["config"])),
        "multi_turn": types.SimpleNamespace(**GOMOKU["multi_turn"])})
    assert job_spec_from_config(ns).spec == job_spec_from_config(GOMOKU).spec


def test_omegaconf_configs_map_with_interpolations_resolved():
    omegaconf = pytest.importorskip("omegaconf")
    turns = {"max_user_turns": "${interaction.config.max_total_steps}", "max_assistant_turns": 39}
    cfg = omegaconf.OmegaConf.create({**GOMOKU, "multi_turn": turns})
    assert job_spec_from_config(cfg).spec.sampling.max_turns == 39


def test_env_names_are_made_servable():
    assert (env_name("Math"), env_name("my game!"), env_name("__x"), env_name("")) == ("math", "my-game-", "x", "env")


class AddGame(AbstractGame):
    """One-digit addition: reply with just the number."""

    def __init__(self, offset: int = 0, label: str = ""):
        self.offset, self.label = offset, label

    def generate_initial_state(self, seed: int, split: str = "train") -> dict:
        return {"a": seed % 10, "b": (seed * 7 + 3) % 10}

    def reset(self, a: int = 0, b: int = 0, **_) -> str:
        self.answer = a + b + self.offset
        return f"{a} + {b}"

    def step(self, action: str) -> StepResult:
        ok = action.strip() == str(self.answer)
        return StepResult("", 1.0 if ok else 0.0, True, {"correct": ok})

    def get_system_prompt(self) -> str:
        return "Answer with just the number."

    def get_initial_user_message(self) -> str:
        return "What is"


class MathLikeGame(AbstractGame):
    """As upstream's MathGame: the problem is in the dataset's prompt, reset gets the
    ground truth, and get_user_message_with_state is a placeholder."""

    def __init__(self, strict: bool = False):
        self.strict = strict

    def reset(self, ground_truth=None, data_source="math", extra_info=None, **kwargs) -> str:
        self.ground_truth, self.data_source, self.extra_info = ground_truth, data_source, extra_info
        return ""

    def step(self, action: str) -> StepResult:
        m = re.search(r"\\boxed\{([^}]+)\}", action)  # else the whole reply, as upstream's fallback
        ok = (m.group(1) if m else action).strip() == str(self.ground_truth)
        return StepResult("", 1.0 if ok else 0.0, True, {"data_source": self.data_source})

    def get_system_prompt(self) -> str:
        return "Put your final answer in \\boxed{}."

    def get_initial_user_message(self) -> str:
        return "Please solve the following problem:"

    def get_user_message_with_state(self, **kwargs) -> str:
        return self.get_initial_user_message()

    def get_interaction_name(self) -> str:
        return "math"


@pytest.fixture
def math_data(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    train = [
        {"data_source": "lighteval/MATH", "prompt": [{"role": "user", "content": "1 + 1?"}],
         "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0}},
        {"data_source": None, "prompt": [{"role": "system", "content": "Be terse."},
                                          {"role": "user", "content": "2 + 2?"}],
         "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"index": 1}},
        {"data_source": "lighteval/MATH", "prompt": [{"role": "user", "content": "3 + 3?"}],
         "reward_model": {"style": "rule", "ground_truth": "6"}, "extra_info": {"index": 2}},
    ]
    val = [{"prompt": "10 + 10?", "ground_truth": "20"}]
    pq.write_table(pa.Table.from_pylist(train), tmp_path / "train.parquet")
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val))
    return tmp_path


def test_a_dataset_env_opens_episodes_with_the_rows_on_the_client(math_data):
    env = GameEnvironment(MathLikeGame, {"data_path": str(math_data / "train.parquet"), "batch_size": 2,
                                         "val_data_path": str(math_data / "test.jsonl")})
    served = env.served_class
    assert (env.interaction_name, env.steps_per_epoch, env.has_validation, env.eval_episodes) == ("math", 1, True, 1)
    state = initial_state(served, {}, 4, "train")  # as envhost asks: row 4 % 3
    assert state == {"_ot_row": 1, "_ot_split": "train"}  # the row's index only: the ground truth stays here
    game, system, user, _ = open_episode(served, {}, state)
    assert (system, user) == ("Be terse.", "2 + 2?")
    assert (game.ground_truth, game.data_source, game.extra_info) == ("4", "math", {"index": 1})
    assert take_step(game, "so \\boxed{4}").reward == 1.0
    game, system, user, _ = open_episode(served, {}, initial_state(served, {}, 6, "train"))
    assert (system, user, game.ground_truth, game.data_source) == (
        "Put your final answer in \\boxed{}.", "1 + 1?", "2", "lighteval/MATH")
    game, _, user, _ = open_episode(served, {}, initial_state(served, {}, 6, "test"))  # the eval split
    assert (user, game.ground_truth) == ("10 + 10?", "20")
    train, val = env.get_dataloader()
    assert len(train) == 1 and [len(b) for b in val] == [1]


def test_a_dataset_row_with_an_assistant_turn_is_refused_at_load(tmp_path):
    row = {"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "ground_truth": "1"}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="d.jsonl row 0.*'assistant'"):
        GameEnvironment(MathLikeGame, {"data_path": str(tmp_path / "d.jsonl")})


def test_the_served_class_binds_game_kwargs_and_the_job_env_args_win():
    env = GameEnvironment(AddGame, {"interaction": {"name": "Add Game"}}, game_kwargs={"offset": 1, "label": "x"})
    assert env.interaction_name == "add-game" and env.has_validation and env.steps_per_epoch == 100
    game, system, user, _ = open_episode(env.served_class, {}, initial_state(env.served_class, {}, 2, "train"))
    assert (game.offset, game.label, system, user) == (1, "x", "Answer with just the number.", "What is\n\n2 + 7")
    game, *_ = open_episode(env.served_class, {"offset": 5}, {"a": 1, "b": 1})
    assert (game.offset, game.label, game.answer) == (5, "x", 7)
    assert env.served_class.__name__ == "AddGame" and not env.serving
    assert GameEnvironment(AddGame, {}).interaction_name == "add"
    with pytest.raises(ValueError, match="reward_function"):
        GameEnvironment(AddGame, {}, reward_function=object())


def test_fit_submits_the_env_name_steps_checkpoints_and_evaluation(math_data):
    spec = job_spec_from_config({"batch_size": 2, "lora": {"lora_rank": 8}}).spec
    game_env = GameEnvironment(AddGame, {"num_steps": 7})
    got = plan_job(spec, game_env, num_epochs=2, save_freq=5, test_freq=3)
    assert (got.env, got.steps, got.checkpoint_every, got.eval_every, got.eval_episodes) == ("add", 14, 5, 3, 50)
    assert plan_job(spec, game_env, num_epochs=2, num_steps=4).steps == 4  # num_steps wins, as upstream
    data_env = GameEnvironment(MathLikeGame, {"data_path": str(math_data / "train.parquet"), "batch_size": 1})
    got = plan_job(spec, data_env, num_epochs=2, save_freq=0, test_freq=3)
    assert (got.env, got.steps, got.checkpoint_every, got.eval_every) == ("math", 6, 1_000_000, 0)  # no val rows


def test_submit_job_reserves_an_id_and_a_cancelled_reservation_never_trains():
    scheduler = SchedulerClient(url="http://127.0.0.1:9/", api_key="otk-test")
    got = scheduler.submit_job(config={"experiment_name": "Add Run", "num_gpus": 8}, num_gpus=8)
    assert JOB_ID_RE.match(got["job_id"]) and got["job_id"].startswith("add-run-")
    assert (got["server_url"], got["status"]) == ("http://127.0.0.1:9", "RESERVED") and "num_gpus" in got["ignored"]
    assert scheduler.cancel_job(got["job_id"])["status"] == "CANCELLED"
    env = GameEnvironment(AddGame, {}, job_id=got["job_id"])
    with pytest.raises(RuntimeError, match="cancelled before fit"):
        ServiceClient(server_url=got["server_url"]).fit(env=env, num_steps=1)
    assert not env.serving
    with pytest.raises(ValueError, match="ppo_magic"):
        scheduler.submit_job(config={"adv_estimator": "ppo_magic"})
    with pytest.raises(NotImplementedError, match="ServiceClient"):
        HTTPTrainingClient("http://127.0.0.1:9")


class _Model(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint that adds the two numbers of the last user
    message, wrong when the first is 3; 401 without the token."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/jobs/j1/v1/chat/completions" or self.headers.get("Authorization") != "Bearer tok":
            self.send_response(401 if self.path.endswith("/chat/completions") else 404)
            self.end_headers()
            return
        self.server.requests.append(body)
        a, b = map(int, re.findall(r"\d+", body["messages"][-1]["content"])[:2])
        text = str(a + b + (a == 3))
        out = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                          "usage": {"prompt_tokens": 20, "completion_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def model_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Model)
    server.requests = []
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server, f"http://127.0.0.1:{server.server_port}/jobs/j1/v1"
    server.shutdown()
    server.server_close()


def test_run_inference_writes_upstreams_jsonl_and_prints_its_summary(model_server, tmp_path, capsys):
    server, url = model_server
    register_endpoint("j1", url, "tok", "smollm2-135m-instruct")
    try:
        out = tmp_path / "res" / "results.jsonl"
        results = run_inference(game_class=AddGame, job_id="j1", output_path=str(out), max_samples=4,
                                max_tokens=16, offset=0)
    finally:
        forget_endpoint("j1")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [list(r) for r in rows] == [["sample_id", "prompt_text", "response_text", "reward", "done", "num_turns",
                                        "ground_truth", "info", "messages"]] * 4
    # seeds 42..45: 2+7, 3+4 (answered wrong), 4+1, 5+8
    assert [(r["response_text"], r["reward"], r["num_turns"]) for r in rows] == [
        ("9", 1.0, 2), ("8", 0.0, 2), ("5", 1.0, 2), ("13", 1.0, 2)]
    assert rows[0]["messages"] == [{"role": "system", "content": "Answer with just the number."},
                                   {"role": "user", "content": "What is\n\n2 + 7"},
                                   {"role": "assistant", "content": "9"}]
    assert rows[0]["info"] == {"env_info": [{"correct": True}]} and rows[0]["prompt_text"].endswith(
        "<|im_start|>assistant\n")
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 1.0]
    assert server.requests[0]["model"] == "smollm2-135m-instruct" and server.requests[0]["temperature"] == 0.0
    printed = capsys.readouterr().out
    assert "Inference Complete: 4 samples in" in printed and "Mean reward: 0.7500" in printed
    assert "Accuracy: 3/4 (75.0%)" in printed


def test_run_inference_reads_the_dataset_and_needs_the_token(model_server, math_data):
    _, url = model_server
    results = run_inference(data_path=str(math_data / "train.parquet"), game_class=MathLikeGame,
                            vllm_server_url=url, api_key="tok", max_samples=2)
    assert [(r.ground_truth, r.reward, r.messages[0]["content"]) for r in results] == [
        ("2", 1.0, "Put your final answer in \\boxed{}."), ("4", 1.0, "Be terse.")]
    assert results[1].info == {"env_info": [{"data_source": "math"}]}
    with pytest.raises(RuntimeError, match="refused the bearer token"):
        run_inference(game_class=AddGame, vllm_server_url=url, max_samples=1)
    with pytest.raises(ValueError, match="no endpoint"):
        run_inference(game_class=AddGame, model_path="some/model", max_samples=1)


def test_upstream_gae_config_trains_a_critic_one_episode_a_prompt(caplog):
    """upstream's android_world_param.yaml, verbatim: adv_estimator "gae" (PPO with a
    critic) with rollout_n 1; upstream's server samples one episode a prompt for gae
    whatever rollout_n says, and so does the mapping."""
    from omegaconf import OmegaConf

    aw = OmegaConf.load(Path(__file__).resolve().parents[1] / "fixtures" / "upstream_client" / "client_config"
                        / "android_world_param.yaml")
    spec, _ = job_spec_from_config(aw)
    assert (spec.advantage_estimator, spec.advantage, spec.group_size, spec.prompts_per_step) == \
        ("gae", "episode", 1, 4)
    aw.rollout_n = 8
    with caplog.at_level("INFO", logger="opentinker.client"):
        spec, _ = job_spec_from_config(aw)
    assert spec.group_size == 1 and "rollout_n 8 -> 1" in caplog.text
