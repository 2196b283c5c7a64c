"""OpenTelemetry across the services: a short job with the console exporter
(OTEL_TRACES_EXPORTER=console, one JSON span per line in each service's output); one
episode's spans from rollout, envhost and learner share a trace id, parent to child
through the message headers, and the learner's step phases and the rollout's weight
application are spans too."""

import json

from opentinker.schemas import JobState
from opentinker.sdk import Client

from conftest import follow, submit_when_ready


def spans_in(log_dir) -> list[dict]:
    out = []
    for f in sorted(log_dir.glob("*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith('{"name"'):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line another thread's output cut into
    return out


async def test_one_episode_is_one_trace_across_rollout_envhost_and_learner(services, nats_url, tmp_path,
                                                                          tiny_model, job_id):
    env = {"OTEL_TRACES_EXPORTER": "console"}
    for name in ("scheduler", "envhost", "learner"):
        services.start(name, env=env)
    services.start("rollout", "engine=hf", env=env)
    spec = {"name": "traced", "model": tiny_model, "env": "guess-number", "engine": "hf", "steps": 2,
            "prompts_per_step": 1, "group_size": 2, "checkpoint_every": 100, "env_args": {"n": 100, "max_turns": 2},
            "sampling": {"max_new_tokens": 8, "max_total_tokens": 512, "max_turns": 2},
            # every phase must run: train even groups without signal (the random tiny
            # model's rewards are all equal), and sample step 1 with policy 1
            "skip_zero_variance": False, "max_staleness": 0}
    async with await Client.connect(nats_url) as client:
        job = await submit_when_ready(client, spec, job_id)
        await follow(job, 300, services)
        assert (await job.wait(timeout_s=60)).state == JobState.COMPLETED
    services.stop_all()  # every span is out (the console exporter writes each as it ends)

    spans = spans_in(tmp_path)
    service = {s["context"]["span_id"]: s["resource"]["attributes"]["service.name"] for s in spans}
    episode = next(s for s in spans if s["name"] == "rollout.episode" and s["attributes"]["ot.job_id"] == job_id)
    eid, trace_id = episode["attributes"]["ot.episode_id"], episode["context"]["trace_id"]
    mine = [s for s in spans if s["context"]["trace_id"] == trace_id]
    by_name = {}
    for s in mine:
        by_name.setdefault(s["name"], []).append(s)

    # the trace starts at the learner's request and runs rollout -> envhost -> learner
    root = by_name["learner.request"][0]
    assert root["parent_id"] is None and service[root["context"]["span_id"]] == "opentinker-learner"
    group = by_name["rollout.group"][0]
    assert group["parent_id"] == root["context"]["span_id"]
    assert episode["parent_id"] == group["context"]["span_id"]
    steps = [s for s in by_name["rollout.env_step"] if s["parent_id"] == episode["context"]["span_id"]]
    served = [s for s in mine if s["name"] == "envhost EnvStepRequest" and s["attributes"]["ot.episode_id"] == eid]
    assert steps and served and {s["parent_id"] for s in served} <= {s["context"]["span_id"] for s in steps}
    assert all(service[s["context"]["span_id"]] == "opentinker-envhost" for s in served)
    assert any(s["attributes"]["ot.episode_id"] == eid for s in mine if s["name"] == "envhost EnvResetRequest")
    published = next(s for s in by_name["rollout.publish_trajectory"] if s["attributes"]["ot.episode_id"] == eid)
    assert published["parent_id"] == episode["context"]["span_id"]
    learned = next(s for s in by_name["learner.trajectory"] if s["attributes"].get("ot.episode_id") == eid)
    assert learned["parent_id"] == published["context"]["span_id"]
    assert service[learned["context"]["span_id"]] == "opentinker-learner"

    # batched generation links to the episodes it served; the step phases and the
    # weight application are spans of their own
    gen = [s for s in spans if s["name"] == "rollout.generate"]
    assert any(link["context"]["span_id"] == episode["context"]["span_id"] for s in gen for link in s["links"])
    names = {s["name"] for s in spans}
    assert {"learner.step", "learner.batch", "learner.forward_backward", "learner.optimizer",
            "learner.publish_weights", "rollout.load_policy"} <= names, names
    step = next(s for s in spans if s["name"] == "learner.step")
    children = {s["name"] for s in spans if s["parent_id"] == step["context"]["span_id"]}
    assert {"learner.batch", "learner.forward_backward", "learner.optimizer", "learner.publish_weights"} <= children
