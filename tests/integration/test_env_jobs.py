"""Every built-in environment trains a few steps through the real services with the
tiny model, and its episodes land in the Parquet log with the turns, masks and
rewards it should; periodic evaluation, turn-level credit, a user env that raises,
and inference on the trained policy."""

import json
import re
from pathlib import Path

import pytest

from opentinker.schemas import JobState
from opentinker.sdk import Client
from opentinker.services.core.logdb import run_query

from conftest import follow, log_rows, submit_when_ready, train_jobs
from fixtures.gsm8k_data import SAMPLE as GSM8K_SAMPLE

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def spec(model: str, env: str, **kw) -> dict:
    sampling = {"temperature": 1.0, "max_new_tokens": 8, "max_total_tokens": 768, "max_turns": 1}
    sampling.update(kw.pop("sampling", {}))
    return {"model": model, "env": env, "engine": "hf", "lora_rank": 4, "prompts_per_step": 2,
            "group_size": 2, "steps": 2, "lr": 1e-3, "checkpoint_every": 2, "sampling": sampling, **kw}


def start_stack(services, data_dir, envhost_args=None, engine: str = "hf"):
    for name in ("scheduler", "learner"):
        services.start(name)
    services.start("envhost", args=envhost_args)
    services.start("rollout", f"engine={engine}")
    services.start("recorder", f"data_dir={data_dir}", "recorder_flush_s=0.5")


def episodes(data_dir, job_id: str, where: str = "true") -> list[dict]:
    cols, rows = run_query(
        f"SELECT reward, token_ids, loss_mask, logprobs, prompt_len, turns, env_info, error, split "
        f"FROM trajectories WHERE job_id = '{job_id}' AND {where}", str(data_dir))
    return [dict(zip(cols, r)) for r in rows]


def check_episode(ep: dict) -> None:
    """Token-exact masks and turn records: loss_mask is 1 exactly on every turn's
    [gen_start, gen_end), sampled tokens have logprobs, and the reward is the sum of
    the turn rewards."""
    ids, mask, lps, turns = ep["token_ids"], ep["loss_mask"], ep["logprobs"], ep["turns"]
    assert len(ids) == len(mask) == len(lps)
    expect = [0] * len(ids)
    for t in turns:
        assert ep["prompt_len"] <= t["gen_start"] <= t["gen_end"] <= t["obs_end"] <= len(ids)
        expect[t["gen_start"]:t["gen_end"]] = [1] * (t["gen_end"] - t["gen_start"])
    assert list(mask) == expect
    assert all(lp <= 0 for lp, m in zip(lps, mask) if m)
    assert ep["reward"] == pytest.approx(sum(t["reward"] for t in turns))


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory):
    from opentinker.services.envhost.envs.gsm8k import prepare_gsm8k

    src = tmp_path_factory.mktemp("gsm8k-src")
    for split, n in (("train", 20), ("test", 8)):
        lines = (GSM8K_SAMPLE / f"{split}.jsonl").read_text().splitlines()[:n]
        (src / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path_factory.mktemp("gsm8k")
    prepare_gsm8k(src, out)
    return out


async def test_every_builtin_env_trains_and_logs_its_episodes(services, nats_url, tmp_path, tiny_model,
                                                              job_id, gsm8k_dir):
    data_dir = tmp_path / "log"
    start_stack(services, data_dir)
    jobs = {
        "bandit": spec(tiny_model, "bandit", env_args={"arms": 3}, eval_every=1, eval_episodes=4),
        "gomoku": spec(tiny_model, "gomoku", env_args={"size": 5, "win_length": 4, "opponent": "random"},
                       advantage="turn", turn_discount=0.9,
                       sampling={"max_new_tokens": 6, "max_turns": 4, "max_total_tokens": 1536}),
        "code-math": spec(tiny_model, "code-math", env_args={"source": "arith", "max_tool_calls": 2},
                          sampling={"max_new_tokens": 12, "max_turns": 3, "max_total_tokens": 1536}),
        "gsm8k": spec(tiny_model, "gsm8k", env_args={"data_dir": str(gsm8k_dir)}),
        # each episode ends graded by the hidden tests, run in the envhost's sandbox; the
        # tiny model's groups have equal rewards, and are trained on all the same
        "swe": spec(tiny_model, "swe", env_args={"max_turns": 2, "timeout_s": 30}, skip_zero_variance=False,
                    sampling={"max_new_tokens": 8, "max_turns": 2, "max_total_tokens": 1536}),
    }
    handles, metrics = await train_jobs(nats_url, services, jobs, job_id, 900)
    for env, h in handles.items():
        n = jobs[env]["steps"] * jobs[env]["prompts_per_step"] * jobs[env]["group_size"]
        await log_rows(data_dir, f"SELECT count(*) FROM trajectories WHERE job_id = '{h.id}' "
                                 "AND split = 'train'", n)
        eps = episodes(data_dir, h.id, "split = 'train'")
        assert len(eps) == n, env
        for ep in eps:
            check_episode(ep)
        infos = [json.loads(ep["env_info"]) for ep in eps]
        if env == "gomoku":
            # several moves per game, each observation (the board) masked out
            assert any(len(ep["turns"]) > 1 for ep in eps)
            assert all(i.get("result") in ("win", "loss", "draw", "ongoing") for i in infos), infos
        if env == "code-math":
            assert any(len(ep["turns"]) > 1 for ep in eps), "expected a nudge or a tool turn"
            assert all(ep["turns"][0]["observation"] or len(ep["turns"]) == 1 for ep in eps)
        if env == "bandit":
            assert all(len(ep["turns"]) == 1 for ep in eps)
        if env == "gsm8k":
            assert all("correct" in i for i in infos)
        if env == "swe":
            # graded after the 2nd reply (or at a submit, or -0.2 for an edit that did not apply)
            for ep, i in zip(eps, infos):
                assert i["ended"] in ("max_turns", "submit", "patch_failed"), i
                if i["ended"] == "patch_failed":
                    assert ep["reward"] == pytest.approx(-0.2)
                else:
                    assert ep["reward"] == pytest.approx(i["passed"] / i["total"]) and 0 <= ep["reward"] <= 1
                    assert "Hidden tests:" in ep["turns"][-1]["observation"]
            assert any(len(ep["turns"]) == 2 for ep in eps)
            assert all(m.values["skipped_frac"] == 0 for m in metrics["swe"] if m.split == "train")
    # periodic evaluation of the bandit job: before training and after each step, on
    # the held-out split, reported beside the training reward
    evals = [m for m in metrics["bandit"] if m.split == "eval"]
    assert [m.policy_version for m in evals] == [0, 1, 2]
    assert all(m.values["episodes"] == 4 for m in evals)
    assert [m.step for m in metrics["bandit"] if m.split == "train"] == [0, 1]
    await log_rows(data_dir, f"SELECT count(*) FROM metrics WHERE job_id = '{handles['bandit'].id}' "
                             "AND split = 'eval' AND key = 'reward_mean'", 3)
    # the turn-credit job trained on per-token advantages without trouble
    assert all(m.values["loss"] == m.values["loss"] for m in metrics["gomoku"] if m.split == "train")

    # inference with the bandit job's policy (by job id) and its final adapter (by path):
    # the same env class, the same problems for the same seed
    async with await Client.connect(nats_url) as client:
        by_job = await client.infer(env="bandit", env_args={"arms": 3}, job=handles["bandit"].id,
                                    episodes=4, seed=3, out_dir=tmp_path / "infer-job", timeout_s=300)
        adapter = Path(services.home) / "checkpoints" / handles["bandit"].id / "final"
        by_path = await client.infer(env="bandit", env_args={"arms": 3}, model=tiny_model,
                                     adapter=str(adapter), episodes=4, seed=3, timeout_s=300,
                                     out_dir=tmp_path / "infer-adapter")
    for res in (by_job, by_path):
        assert res.summary["episodes"] == 4 and res.summary["policy_version"] == 1
        assert (res.out_dir / "episodes.jsonl").read_text().count("\n") == 4
        assert (res.out_dir / "episodes.parquet").exists()
        assert json.loads((res.out_dir / "summary.json").read_text())["correct_frac"] == res.summary["correct_frac"]
    # greedy, same seed, same weights: the same episodes
    assert [t.turns[0].action for t in by_job.trajectories] == [t.turns[0].action for t in by_path.trajectories]


async def test_env_that_raises_in_step_ends_that_episode_and_the_job_goes_on(services, nats_url, tmp_path,
                                                                             tiny_model, job_id):
    data_dir = tmp_path / "log"
    start_stack(services, data_dir, ["--env", f"{FIXTURES / 'user_env.py'}:RaisingGame"])
    async with await Client.connect(nats_url) as client:
        job = await submit_when_ready(client, spec(tiny_model, "user-raising"), job_id)
        await follow(job, 600, services)
        rec = await job.wait(timeout_s=30, raise_on_failure=False)
    assert rec.state == JobState.COMPLETED, (rec, services.logs())
    await log_rows(data_dir, f"SELECT count(*) FROM trajectories WHERE job_id = '{job_id}'", 8)
    eps = episodes(data_dir, job_id)
    assert len(eps) == 8
    broken = [ep for ep in eps if ep["error"]]
    assert len(broken) == 4, [ep["error"] for ep in eps]
    assert all("KeyError" in ep["error"] and "the user's env has a bug" in ep["error"] for ep in broken)
    assert all(ep["reward"] == 0.0 for ep in broken)
    assert all(ep["reward"] == 1.0 for ep in eps if not ep["error"])


async def test_an_env_written_for_opentinker_trains_unchanged(services, nats_url, tmp_path, tiny_model, job_id):
    """tests/fixtures/seed_envs.py, served from its file: no `name`, argument-free
    generate_initial_state, OpenTinker's prompt hooks. Each group shares one state, and
    the prompts hold the state as OpenTinker renders it."""
    from transformers import AutoTokenizer

    data_dir = tmp_path / "log"
    fixture = FIXTURES / "seed_envs.py"
    start_stack(services, data_dir, ["--env", f"{fixture}:NimGame", "--env", f"{fixture}:SumGame"])
    jobs = {"nim": spec(tiny_model, "nim", env_args={"max_pile": 7},
                        sampling={"max_new_tokens": 4, "max_turns": 3, "max_total_tokens": 1024}),
            "seed_sum": spec(tiny_model, "seed_sum")}
    handles, metrics = await train_jobs(nats_url, services, jobs, job_id)
    for env in jobs:
        assert [m.step for m in metrics[env] if m.split == "train"] == [0, 1], env
    tok = AutoTokenizer.from_pretrained(tiny_model)
    for env, h in handles.items():
        await log_rows(data_dir, f"SELECT count(*) FROM trajectories WHERE job_id = '{h.id}'", 8)
        cols, rows = run_query(f"SELECT step, group_index, token_ids, prompt_len, env_info, turns "
                               f"FROM trajectories WHERE job_id = '{h.id}'", str(data_dir))
        eps = [dict(zip(cols, r)) for r in rows]
        assert len(eps) == 8 and all(ep["turns"] for ep in eps)
        prompts: dict[tuple, set] = {}
        for ep in eps:
            text = tok.decode(ep["token_ids"][:ep["prompt_len"]])
            prompts.setdefault((ep["step"], ep["group_index"]), set()).add(text)
            info = json.loads(ep["env_info"])
            if env == "nim":  # default rendering: the initial message, then reset's observation
                pile = int(re.search(r"Your move\.\n\nThere are (\d+) stones in the pile\.", text).group(1))
                assert 4 <= pile <= 7 and "You are playing Nim" in text
                assert info["pile"] < pile or not info["valid"]
            else:  # get_user_message_with_state, from the group's state
                assert f"What is {info['a']} + {info['b']}?" in text and "Add the numbers" not in text
        assert all(len(texts) == 1 for texts in prompts.values()), prompts  # a group shares its state
        assert len(prompts) == 4
