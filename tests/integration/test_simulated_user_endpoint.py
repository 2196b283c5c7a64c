"""`simulated-user` against the project's own OpenAI-compatible endpoint: an inference job
of SmolLM2-135M-Instruct (transformers engine) placed by the scheduler on a rollout
worker plays the customer (and, in one episode, the judge), and the same endpoint plays
the assistant; a few whole episodes run, and a wrong endpoint token fails a step with
an error naming the URL."""

from __future__ import annotations

import asyncio

import nats.errors
import openai
import pytest

from opentinker.services.core.models import DEFAULT_MODEL
from opentinker.services.envhost.envs.simulated_user import EndpointError, SimulatedUserGame
from opentinker.sdk import Client

KEY_ENV = "OT_TEST_SIMUSER_ENDPOINT_TOKEN"


def play(args: dict, seed: int, policy: openai.OpenAI, model: str) -> list:
    """One episode of the env: the policy's replies from `policy` (greedy, short)."""
    g = SimulatedUserGame(**args)
    state = g.generate_initial_state(seed, "train")
    g.reset(**state)
    chat = [{"role": "system", "content": g.get_system_prompt()},
            {"role": "user", "content": g.get_initial_user_message()}]
    results = []
    for _ in range(args["max_turns"]):
        reply = policy.chat.completions.create(model=model, messages=chat, max_tokens=24, temperature=0)
        action = reply.choices[0].message.content
        r = g.step(action)
        results.append(r)
        if r.done:
            break
        chat += [{"role": "assistant", "content": action}, {"role": "user", "content": r.observation}]
    return results


@pytest.mark.timeout(600)
async def test_episodes_run_against_an_inference_job_of_smollm2(services, nats_url, smollm2, job_id, monkeypatch):
    services.start("scheduler")
    services.start("rollout", "engine=hf", f"worker_id=r-{job_id}")
    async with await Client.connect(nats_url) as client:
        for _ in range(300):  # the scheduler may not answer yet
            try:
                ep = await client.submit_inference_job(model=DEFAULT_MODEL, engine="hf", job_id=f"{job_id}-u")
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.2)
        try:
            monkeypatch.setenv(KEY_ENV, ep.token)
            policy = openai.OpenAI(base_url=ep.url, api_key=ep.token, max_retries=0, timeout=120)
            rule = {"user_base_url": ep.url, "user_model": ep.model, "user_api_key_env": KEY_ENV,
                    "user_max_tokens": 24, "max_turns": 3, "timeout_s": 60}
            for seed, args in ((1, rule), (3, {**rule, "reward": "judge"})):
                results = await asyncio.to_thread(play, args, seed, policy, ep.model)
                assert results and results[-1].done and not any(r.done for r in results[:-1])
                assert len(results) <= args["max_turns"]
                assert all(isinstance(r.observation, str) for r in results)
                assert all(r.reward == 0.0 for r in results[:-1]) and results[-1].reward in (0.0, 1.0)
                info = results[-1].info
                assert info["ended_by"] in ("done", "stop", "max_turns")
                if args.get("reward") == "judge":
                    assert info["judge_verdict"] in ("YES", "NO", "unparsed")
                else:
                    assert results[-1].reward == float(not info["missing"] and not info["forbidden"])

            # a wrong token: the step fails with the endpoint's refusal, naming the URL
            monkeypatch.setenv(KEY_ENV, "otj-wrong")
            g = SimulatedUserGame(**rule)
            g.reset(scenario="refund-1234")
            with pytest.raises(EndpointError, match="HTTP 401") as e:
                await asyncio.to_thread(g.step, "Hello, how can I help?")
            assert ep.url in str(e.value) and ep.token not in str(e.value)
        finally:
            await ep.cancel()
