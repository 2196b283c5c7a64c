"""The thread policy (services.core.config.thread_count): 1 intra-op thread for services
without tensor math, the libraries' defaults for the learner and rollout worker,
overridable per service or for all; the stack's children get it in their environment,
and a service applies it to itself (runner.limit_threads)."""

import json
import os
import subprocess
import sys

import pytest

from opentinker.ops.stack import SERVICES, Stack, core_share
from opentinker.services.core.config import LIGHT_SERVICES, THREAD_ENV_VARS, Settings, thread_count, thread_env

HEAVY = ("learner", "rollout")


def test_defaults_one_thread_for_light_services_and_library_defaults_for_heavy():
    assert set(SERVICES) == LIGHT_SERVICES | set(HEAVY)  # every service the stack starts has a policy
    for s in LIGHT_SERVICES:
        assert thread_count(s, {}) == 1
    for s in HEAVY:
        assert thread_count(s, {}) is None
    assert thread_env(None) == {}
    assert thread_env(3) == {v: "3" for v in THREAD_ENV_VARS}


def test_overrides_most_specific_first():
    env = {"OPENTINKER_THREADS": "2"}
    assert all(thread_count(s, env) == 2 for s in SERVICES)
    assert thread_count("learner", env, configured=5) == 5          # threads= beats OPENTINKER_THREADS
    env["OPENTINKER_LEARNER_THREADS"] = "7"
    assert thread_count("learner", env, configured=5) == 7          # per service beats both
    assert thread_count("rollout", env, configured=0) == 2
    # 0 or empty: unset, fall through to the default
    assert thread_count("envhost", {"OPENTINKER_ENVHOST_THREADS": "0", "OPENTINKER_THREADS": ""}) == 1
    assert thread_count("rollout", {"OPENTINKER_ROLLOUT_THREADS": ""}, configured=0) is None


@pytest.mark.parametrize("env,configured", [({"OPENTINKER_RECORDER_THREADS": "two"}, 0),
                                            ({"OPENTINKER_THREADS": "-1"}, 0), ({}, -2)])
def test_bad_counts_are_refused(env, configured):
    with pytest.raises(ValueError, match="thread count"):
        thread_count("recorder", env, configured)


def test_stack_passes_thread_env(tmp_path, monkeypatch):
    for var in (*THREAD_ENV_VARS, "OPENTINKER_THREADS", *(f"OPENTINKER_{s.upper()}_THREADS" for s in SERVICES)):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPENTINKER_ROLLOUT_THREADS", "2")
    stack = Stack(tmp_path, nats_url="nats://127.0.0.1:1", overrides={"learner": ["threads=3"]})
    envs = {s: stack.child_env(s) for s in SERVICES}
    for s in LIGHT_SERVICES:
        assert all(envs[s][v] == "1" for v in THREAD_ENV_VARS), s
    assert all(envs["rollout"][v] == "2" for v in THREAD_ENV_VARS)
    assert all(envs["learner"][v] == "3" for v in THREAD_ENV_VARS)
    assert envs["envhost"]["NATS_URL"] == "nats://127.0.0.1:1" and envs["envhost"]["OPENTINKER_HOME"] == str(tmp_path)
    monkeypatch.delenv("OPENTINKER_ROLLOUT_THREADS")
    assert not any(v in stack.child_env("rollout") for v in THREAD_ENV_VARS)  # library defaults
    with pytest.raises(ValueError, match="learner"):
        Stack(tmp_path, overrides={"learner": ["threads=x"]}).child_env("learner")


APPLY = """
import json, os
import torch
from opentinker.services.core.config import Settings
from opentinker.services.core.runner import limit_threads
rows = []
for service, extra in (("learner", {}), ("envhost", {}), ("recorder", {"OPENTINKER_RECORDER_THREADS": "3"})):
    os.environ.update(extra)
    before = torch.get_num_threads()
    rows.append([service, before, limit_threads(service, Settings()), torch.get_num_threads(),
                 os.environ.get("OMP_NUM_THREADS")])
print(json.dumps(rows))
"""


def test_service_applies_its_thread_count():
    """In a fresh process (torch's thread pool is process-wide), in this order: a heavy
    service leaves torch's default and OpenMP alone; light ones set both to the policy."""
    env = {k: v for k, v in os.environ.items() if not (k.endswith("_THREADS") and k.startswith("OPENTINKER_"))
           and k not in THREAD_ENV_VARS}
    out = subprocess.run([sys.executable, "-c", APPLY], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    (_, before, n, after, omp), *light = json.loads(out.stdout.strip().splitlines()[-1])
    assert n is None and after == before and omp is None
    assert [row[2:] for row in light] == [[1, 1, "1"], [3, 3, "3"]]


def test_stack_starts_more_rollout_workers_under_their_own_ids(tmp_path):
    stack = Stack(tmp_path, nats_url="nats://127.0.0.1:1", rollout_workers=3)
    ids = {stack.worker_id(n) for n in ("rollout", "rollout-2", "rollout-3")}
    assert len(ids) == 3 and all(i.startswith("rollout") for i in ids)
    with pytest.raises(ValueError, match="rollout_workers"):
        Stack(tmp_path, rollout_workers=0)


def test_rollout_workers_on_one_host_split_its_cores(tmp_path, monkeypatch):
    assert [core_share(list(range(8)), i, 3) for i in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert [core_share([0, 1], i, 3) for i in range(3)] == [[0], [1], [0]]
    assert core_share([4, 5], 0, 1) == [4, 5]
    for var in (*THREAD_ENV_VARS, "OPENTINKER_THREADS", "OPENTINKER_ROLLOUT_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    stack = Stack(tmp_path, nats_url="nats://127.0.0.1:1", rollout_workers=2)
    one, two = stack.child_env("rollout"), stack.child_env("rollout-2")
    assert (one["VLLM_CPU_OMP_THREADS_BIND"], two["VLLM_CPU_OMP_THREADS_BIND"]) == ("0,1", "2,3")
    assert one["OMP_NUM_THREADS"] == two["OMP_NUM_THREADS"] == "2"
    # a single worker keeps vLLM's own binding; what the operator sets wins
    assert "VLLM_CPU_OMP_THREADS_BIND" not in Stack(tmp_path, nats_url="nats://127.0.0.1:1").child_env("rollout")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("OPENTINKER_ROLLOUT_THREADS", "4")
    two = stack.child_env("rollout-2")
    assert two["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and two["OMP_NUM_THREADS"] == "4"


def test_the_stack_leaves_the_async_thread_count_to_the_operator(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENTINKER_LEARNER_ASYNC_THREADS", raising=False)
    stack = Stack(tmp_path, nats_url="nats://127.0.0.1:1")
    assert "OPENTINKER_LEARNER_ASYNC_THREADS" not in stack.child_env("learner")
    monkeypatch.setenv("OPENTINKER_LEARNER_ASYNC_THREADS", "1")
    assert stack.child_env("learner")["OPENTINKER_LEARNER_ASYNC_THREADS"] == "1"
    assert Settings().learner_async_threads == 0


def test_an_async_step_on_a_cpu_trains_with_the_async_thread_count_and_gives_the_threads_back():
    import torch

    from opentinker.schemas import JobSpec
    from opentinker.services.core.runner import torch_threads
    from opentinker.services.learner.job import JobRun

    seen = []

    class Engine:
        device = "cpu"

        def train_step(self, *a):
            seen.append(torch.get_num_threads())

    run = JobRun.__new__(JobRun)  # only what async_threads reads
    run.engine, run.settings = Engine(), Settings(learner_async_threads=1)
    before = torch.get_num_threads()
    for staleness, expect in ((1, 1), (0, 0)):
        run.spec = JobSpec(max_staleness=staleness)
        assert run.async_threads() == expect
        with torch_threads(run.async_threads()):
            run.engine.train_step()
        assert torch.get_num_threads() == before
    assert seen == [1, before]
    run.engine.device = "cuda"  # a GPU step's host threads are not the generation's cores
    run.spec = JobSpec(max_staleness=1)
    assert run.async_threads() == 0
