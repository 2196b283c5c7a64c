"""The pieces upstream OpenTinker's client scripts import beyond its client API
(client/run_script.py, client/utils/{utils,scheduler_client_lifecycle}.py,
environment/math, environment/game_stats_client.py); the scripts themselves run in
tests/integration/test_upstream_scripts.py."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from opentinker.client.utils.scheduler_client_lifecycle import SchedulerClientLifecycleManager
from opentinker.client.utils.utils import resolve_path, resolve_paths_in_config, tolerant_merge_dicts
from opentinker.environment.game_stats_client import GameStatsClient, record_episode
from opentinker.environment.math import MathGame
from opentinker.environment.math import math_game
from opentinker.environment.math.math_env import MathGameEnvironment
from tests.fixtures.upstream_data import geo3k_rows, upstream_class

OPENTINKER = str(Path(sys.executable).parent / "opentinker")


@pytest.mark.parametrize("reply, gold, reward", [
    ("so the answer is \\boxed{42}", "42", 1.0),
    ("Janet makes 9 * 2 = $18 a day.\n#### 18", "18", 1.0),
    ("half of it: \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{41}", "42", 0.0),
    ("no answer at all", "42", 0.0),
])
def test_math_game_scores_the_reply_against_the_ground_truth(reply, gold, reward):
    game = MathGame()
    assert game.reset(ground_truth=gold, data_source="openai/gsm8k", extra_info={"index": 3}) == ""
    r = game.step(reply)
    assert (r.reward, r.done) == (reward, True)
    assert r.info["ground_truth"] == gold and r.info["index"] == 3 and r.info["attempt"] == 1
    again = game.step(reply)  # single turn: over after one reply
    assert (again.reward, again.done, again.info) == (0.0, True, {"error": "game_over"})


def test_math_game_answer_pattern_and_the_fallback_without_math_verify(monkeypatch):
    game = MathGame(answer_pattern=r"ANSWER: (\S+)")
    game.reset(ground_truth="7")
    assert game.step("ANSWER: 7").reward == 1.0
    game.reset(ground_truth="7")
    assert game.step("\\boxed{7}").reward == 0.0  # the pattern is required

    import opentinker.services.envhost.envs.answers as answers

    def missing(*a):
        raise ImportError("math_verify")

    monkeypatch.setattr(answers, "verify_answer", missing)
    assert math_game.score_answer("so \\boxed{ 12 }", "12") == 1.0  # upstream's containment fallback
    assert math_game.score_answer("\\boxed{13}", "12") == 0.0


def _rows(path: Path, n: int) -> None:
    import json

    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i} + {i}?"}],
                                        "reward_model": {"ground_truth": str(2 * i)}, "data_source": "arith"}) + "\n"
                            for i in range(n)))


def test_math_game_environment_takes_upstreams_constructor(tmp_path):
    _rows(tmp_path / "train.jsonl", 6)
    _rows(tmp_path / "val.jsonl", 2)
    cfg = {"batch_size": 2, "interaction": {"name": "math"}, "val_batch_size": 2}
    env = MathGameEnvironment(MathGame, cfg, str(tmp_path / "train.jsonl"), [str(tmp_path / "val.jsonl")],
                              job_id="j-1")
    assert (env.data_paths, env.val_data_paths, env.job_id) == ([str(tmp_path / "train.jsonl")],
                                                               [str(tmp_path / "val.jsonl")], "j-1")
    assert (env.steps_per_epoch, env.eval_episodes, env.interaction_name) == (3, 2, "math")
    game = env.served_class()
    state = game.generate_initial_state(4, "train")
    game.reset(**state)
    assert game.get_user_message_with_state(**state) == "4 + 4?" and game.step("\\boxed{8}").reward == 1.0
    with pytest.raises(ValueError, match="data_paths"):
        MathGameEnvironment(MathGame, cfg, [])


def test_game_stats_client_counts_the_episodes_of_its_job():
    a, b = GameStatsClient("http://0.0.0.0:8088", job_id="stats-a"), GameStatsClient("", job_id="stats-b")
    assert a.health_check() and a.reset_all()["job_id"] == "stats-a"
    record_episode("stats-a", 1.0, 1.0, 1, True)
    record_episode("stats-a", 0.0, 0.5, 2, True)
    record_episode("stats-a", 0.0, 0.0, 3, False)
    record_episode("stats-b", 1.0, 1.0, 1, True)
    s = a.get_all_stats()
    assert (s["total_samples"], s["games_in_step"], s["incomplete_samples"]) == (3, 2, 1)
    assert (s["mean_final_reward"], s["mean_sum_reward"], s["mean_game_steps"]) == (0.5, 0.75, 1.5)
    assert s["cumulative"]["total_games"] == 2 and {"stats-a", "stats-b"} <= set(a.list_jobs()["jobs"])
    assert a.reset_step()["step"] == 1 and a.get_step_stats()["total_samples"] == 0
    assert a.get_cumulative_stats()["total_samples"] == 3  # a new step keeps the totals
    assert b.get_step_stats()["games_in_step"] == 1  # another job's figures are its own
    a.reset_all(), b.reset_all()
    assert a.get_cumulative_stats() == {"job_id": "stats-a"}


def test_resolve_paths_in_config_as_upstream_but_keeps_model_names(tmp_path):
    (tmp_path / "local-model").mkdir()
    assert resolve_path("data/train.parquet", str(tmp_path)) == str(tmp_path / "data/train.parquet")
    assert resolve_path("Qwen/Qwen2.5-1.5B", str(tmp_path)) == "Qwen/Qwen2.5-1.5B"  # a Hugging Face id
    assert resolve_path("smollm2-135m-instruct", str(tmp_path)) == "smollm2-135m-instruct"  # a model name here
    assert resolve_path("local-model", str(tmp_path)) == str(tmp_path / "local-model")  # a folder there
    assert resolve_path("/abs/x.json", str(tmp_path)) == "/abs/x.json"
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"data_path": "d/t.jsonl", "val_data_path": None, "tokenizer_path": "a/b", "other": "x/y"})
    resolve_paths_in_config(cfg, str(tmp_path))
    assert (cfg.data_path, cfg.val_data_path, cfg.tokenizer_path, cfg.other) == (str(tmp_path / "d/t.jsonl"), None,
                                                                                 "a/b", "x/y")
    with pytest.warns(RuntimeWarning, match="'k' overridden"):
        assert tolerant_merge_dicts({"a": {"x": 1}, "k": 1}, None, {"a": {"y": 2}, "k": {"z": 3}}) == {
            "a": {"x": 1, "y": 2}, "k": {"z": 3}}


class _Scheduler:
    """A stand-in with SchedulerClient's job-status surface: what the manager calls."""

    def __init__(self, status: str, kind: str | None = "train"):
        self.status, self.kind, self.calls = status, kind, []

    def get_job_status(self, job_id):
        return {"job_id": job_id, "status": self.status, **({"kind": self.kind} if self.kind else {})}

    def cancel_job(self, job_id):
        self.calls.append(("cancel", job_id))
        return {"status": "CANCELLED", "message": "cancelled by the client"}

    def complete_job(self, job_id):
        self.calls.append(("complete", job_id))
        return {"status": "COMPLETED", "message": "completed by the client"}


@pytest.mark.parametrize("status, kind, calls", [
    ("RUNNING", "train", [("cancel", "j")]),
    ("RUNNING", "inference", [("complete", "j")]),
    ("RESERVED", None, [("cancel", "j")]),
    ("COMPLETED", "train", []),
    ("FAILED", "inference", []),
])
def test_the_lifecycle_manager_ends_only_a_job_still_open(status, kind, calls):
    m, sched, order = SchedulerClientLifecycleManager(), _Scheduler(status, kind), []
    m.register_job(sched, "j")
    m.add_cleanup_callback(lambda: order.append("callback"))
    m.add_cleanup_callback(lambda: 1 / 0)  # a failing callback is reported, the rest still run
    m._cleanup_all()
    m._cleanup_all()  # once only
    assert sched.calls == calls and order == ["callback"]
    with pytest.raises(NotImplementedError, match="reward"):
        m.start_reward_server()


def test_a_script_ends_its_registered_job_on_sigterm(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        from opentinker.client.utils.scheduler_client_lifecycle import get_lifecycle_manager
        class S:
            def get_job_status(self, job_id): return {"status": "RUNNING", "kind": "train"}
            def cancel_job(self, job_id): print("cancel", job_id, flush=True); return {"status": "CANCELLED"}
        get_lifecycle_manager().register_job(S(), "job-1")
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached")
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "cancel job-1" in r.stdout and "not reached" not in r.stdout, r


def test_upstream_binds_utils_to_this_package_over_the_scripts_own(tmp_path):
    """`opentinker upstream SCRIPT ARGS`: the script's `utils.*` imports reach this
    package even beside upstream's own utils folder, and it sees its own argv."""
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text("raise ImportError('upstream utils imported')\n")
    (tmp_path / "helper.py").write_text("VALUE = 7\n")  # the script's folder is on sys.path, as with `python SCRIPT`
    (tmp_path / "s.py").write_text(textwrap.dedent("""
        import sys
        from utils.http_training_client import SchedulerClient
        from utils.utils import resolve_paths_in_config
        from utils.scheduler_client_lifecycle import get_lifecycle_manager
        import helper
        import logging
        assert logging.getLogger("httpx").level == logging.WARNING  # no line per status poll under hydra
        print(SchedulerClient.__module__, resolve_paths_in_config.__module__, helper.VALUE, sys.argv[1:])
    """))
    r = subprocess.run([OPENTINKER, "upstream", str(tmp_path / "s.py"), "a=1", "--flag"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["opentinker.client.utils.http_training_client", "opentinker.client.utils.utils",
                                "7", "['a=1',", "'--flag']"]
    r = subprocess.run([OPENTINKER, "upstream", str(tmp_path / "missing.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "missing.py: no such script" in r.stderr


@pytest.mark.parametrize("kwargs", [{}, {"board_size": 5, "win_length": 3, "max_total_steps": 12},
                                    {"board_size": 7, "win_length": 4, "max_initial_moves": 4,
                                     "empty_board_prob": 0.0}])
def test_gomoku_plays_exactly_as_upstreams(kwargs):
    """Same seeds, same replies: every state, prompt, observation, reward, done flag and
    info of this GomokuGame equals upstream's, over 30 games of legal, illegal and
    malformed moves (the opponent draws from `random`, seeded alike before each step)."""
    import random

    from opentinker.environment.gomoku import GomokuGame

    Upstream = upstream_class("gomoku_game", "GomokuGame")
    for seed in range(30):
        ours, theirs = GomokuGame(**kwargs), Upstream(**kwargs)
        random.seed(seed)
        state = ours.generate_initial_state()
        random.seed(seed)
        assert theirs.generate_initial_state() == state
        for method in ("get_system_prompt", "get_initial_user_message", "get_interaction_name"):
            assert getattr(ours, method)() == getattr(theirs, method)()
        assert ours.get_user_message_with_state(**state) == theirs.get_user_message_with_state(**state)
        assert ours.reset(**state) == theirs.reset(**state)
        moves = random.Random(seed)
        for t in range(60):
            n = ours.board_size
            kind = moves.random()
            if kind < 0.1:
                action = "I think the centre."
            elif kind < 0.15:
                action = f"<move>{n},{moves.randrange(n)}</move>"
            else:
                r, c = moves.randrange(n), moves.randrange(n)  # sometimes a taken cell
                action = f"<thinking>t{t}</thinking><move> {r} , {c} </move>"
            random.seed(seed * 1000 + t)
            a = ours.step(action)
            random.seed(seed * 1000 + t)
            b = theirs.step(action)
            assert (a.observation, a.reward, a.done, a.info) == (b.observation, b.reward, b.done, b.info), (seed, t)
            assert ours.get_state() == theirs.get_state()
            if a.done:
                break


def test_a_served_game_records_its_episodes_for_the_stats_client():
    from opentinker.environment.base_game_environment import GameEnvironment
    from opentinker.environment.gomoku import GomokuGame

    env = GameEnvironment(GomokuGame, {"batch_size": 2}, game_kwargs={"board_size": 5, "max_total_steps": 3},
                          job_id="gomoku-stats")
    stats = GameStatsClient("", job_id="gomoku-stats")
    stats.reset_all()
    game = env.served_class()
    game.reset()
    assert game.step("<move>9,9</move>").reward == -1.0  # out of bounds: the game goes on
    game.step("<move>0,0</move>")
    r = game.step("<move>0,1</move>")  # the 3rd step: the timeout
    assert (r.reward, r.done) == (-20.0, True)
    game.close()  # the env host closes an ended episode
    game.close()  # recorded once
    s = stats.get_all_stats()
    assert (s["total_samples"], s["games_in_step"], s["mean_final_reward"], s["mean_game_steps"]) == (1, 1, -20.0, 3)
    assert (s["total_losses"], s["cumulative_win_rate"], s["loss_rate"]) == (1, 0.0, 1.0)
    stats.reset_all()


def test_upstream_reports_a_scripts_missing_import_as_the_script_would(tmp_path):
    (tmp_path / "own.py").write_text("import my_own_missing_module\n")
    r = subprocess.run([OPENTINKER, "upstream", str(tmp_path / "own.py")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "No module named 'my_own_missing_module'" in r.stderr
    assert "extra of opentinker" not in r.stderr and "opentinker[upstream]" not in r.stderr
    (tmp_path / "aw.py").write_text("from opentinker.environment.android_world import AndroidWorldGame\n")
    r = subprocess.run([OPENTINKER, "upstream", str(tmp_path / "aw.py")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "drives a live Android emulator" in r.stderr, r.stderr[-2000:]
    (tmp_path / "hy.py").write_text("raise ModuleNotFoundError(\"No module named 'hydra'\", name='hydra')\n")
    r = subprocess.run([OPENTINKER, "upstream", str(tmp_path / "hy.py")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "imports 'hydra': pip install 'opentinker[upstream]'" in r.stderr, r.stderr


def test_geo3k_rows_carry_their_images_into_the_episode(tmp_path):
    from opentinker.environment.base_game import opening
    from opentinker.environment.geo3k import Geo3KGame, Geo3KGameEnvironment

    pngs = geo3k_rows(tmp_path / "train.parquet", 3)
    env = Geo3KGameEnvironment({"batch_size": 2}, [str(tmp_path / "train.parquet")], job_id="geo")
    assert env.interaction_name == "geo3k" and env.steps_per_epoch == 1 and env.game_class is Geo3KGame
    game = env.served_class()
    state = game.generate_initial_state(1, "train")
    system, user = opening(game, state)
    assert (system, user) == ("", "Find x in figure 1. Put it in \\boxed{}.")  # no system prompt, no placeholder
    assert game.get_initial_images() == [pngs[1]]
    r = game.step("so x = \\boxed{3}")
    assert (r.reward, r.done, r.info["index"], r.info["data_source"]) == (1.0, True, 1, "hiyouga/geometry3k")
    from opentinker.environment.static_data_generator import row_images

    with pytest.raises(ValueError, match=r"images\[0\]: int is no image"):
        row_images([7])


@pytest.mark.parametrize("max_retries", [1, 3])
def test_geo3k_tool_game_answers_as_upstreams(max_retries):
    """Same replies, same feedback: every observation, reward, done flag, info and state
    of this Geo3KToolGame equals upstream's (its verl-less fallback: exact match), over
    attempts that are wrong, unboxed, nested, repeated, right, and after the end."""
    from opentinker.environment.geo3k import Geo3KToolGame

    Upstream = upstream_class("geo3k_tool_game", "Geo3KToolGame")
    episodes = [("12", ["x is \\boxed{10}", "no box", "\\boxed{12}", "\\boxed{12}"]),
                ("\\frac{8}{3}", ["\\boxed{\\frac{8}{3}} and \\boxed{3", "\\boxed{ \\frac{8}{3} }", "x"]),
                ("5", ["\\boxed{4}", "\\boxed{4}", "\\boxed{4}", "\\boxed{5}"]),
                ("7", ["\\boxed{7}", "\\boxed{7}"])]
    for truth, replies in episodes:
        ours, theirs = Geo3KToolGame(max_retries=max_retries), Upstream(max_retries=max_retries)
        for method in ("get_system_prompt", "get_initial_user_message", "get_interaction_name",
                       "generate_initial_state", "get_user_message_with_state"):
            assert getattr(ours, method)() == getattr(theirs, method)()
        kw = {"ground_truth": truth, "extra_info": {"index": 3}}
        assert ours.reset(**kw) == theirs.reset(**kw)
        for action in replies:
            a, b = ours.step(action), theirs.step(action)
            assert (a.observation, a.reward, a.done, a.info) == (b.observation, b.reward, b.done, b.info), action
            assert ours.get_state() == theirs.get_state()


def test_geo3k_tool_game_checks_the_boxed_answer_as_mathematics(tmp_path):
    """Beyond upstream's exact-match fallback: "0.5" answers "\\frac{1}{2}"; an unboxed
    right number is no answer; and Geo3KToolEnvironment serves it on rows with images."""
    from opentinker.environment.geo3k import Geo3KToolEnvironment, Geo3KToolGame

    game = Geo3KToolGame(max_retries=2)
    game.reset(ground_truth="\\frac{1}{2}")
    r = game.step("1/2")
    assert (r.observation, r.reward, r.done) == ("Current parsed answer=(no boxed answer) reward=0.0", -0.05, False)
    r = game.step("so \\boxed{0.5}")
    assert (r.observation, r.reward, r.done, r.info["is_correct"]) == (
        "Current parsed answer=0.5 reward=1.0", 1.0, True, True)
    pngs = geo3k_rows(tmp_path / "train.parquet", 2)
    env = Geo3KToolEnvironment({"batch_size": 2}, [str(tmp_path / "train.parquet")], job_id="geo-tool",
                               max_retries=2)
    assert (env.interaction_name, env.game_kwargs) == ("geo3k_tool", {"max_retries": 2})
    served = env.served_class()
    served.reset(**served.generate_initial_state(0, "train"))
    assert served.get_initial_images() == [pngs[0]]
    assert served.step("\\boxed{1}").reward == -0.05 and served.step("\\boxed{2}").reward == 1.0


def test_the_configs_observation_template_formats_each_step():
    """upstream's interaction.config.observation_template (generic_env_param.yaml's
    "Environment: {observation}"): set aside from the job, applied by the served game
    to each step's observation with the step, the rewards and the info's keys."""
    import random

    from opentinker.client.utils.config import job_spec_from_config
    from opentinker.environment.base_game_environment import GameEnvironment
    from opentinker.environment.gomoku import GomokuGame

    template = "Environment (step {step}, total {cumulative_reward}, {error}): {observation}"
    cfg = {"interaction": {"name": "gomoku", "config": {"observation_template": template}}}
    assert "formats each step" in job_spec_from_config(cfg).ignored["interaction.config.observation_template"]
    env = GameEnvironment(GomokuGame, cfg, game_kwargs={"board_size": 5, "max_total_steps": 3}, job_id="tpl")
    game, plain = env.served_class(), GomokuGame(board_size=5, max_total_steps=3)
    for g in (game, plain):
        random.seed(1)
        g.reset()
    a, b = game.step("<move>9,9</move>"), plain.step("<move>9,9</move>")  # off the board: -1, the game goes on
    assert (a.reward, a.done, a.info) == (b.reward, b.done, b.info)
    assert a.observation == f"Environment (step 1, total -1.0, {b.info['error']}): {b.observation}"
    assert game.step("no move").observation.startswith("Environment (step 2, total -2.0, ")
    bad = GameEnvironment(GomokuGame, {"interaction": {"config": {"observation_template": "{nope}"}}}).served_class()
    bad.reset()
    with pytest.raises(ValueError, match=r"observation_template '\{nope\}': no field 'nope'"):
        bad.step("<move>9,9</move>")
    with pytest.raises(ValueError, match="observation_template '\\{oops'"):
        GameEnvironment(GomokuGame, {"interaction": {"config": {"observation_template": "{oops"}}})
