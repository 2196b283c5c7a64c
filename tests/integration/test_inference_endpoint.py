"""Inference jobs through the scheduler: `submit_inference_job` returns an
OpenAI-compatible URL served by the placed rollout worker, called here with the real
`openai` client. The base model and a trained job's policy (`policy_of`), a wrong
token, another job's URL and a cancelled job."""

import openai
import pytest

from opentinker.schemas import JobState
from opentinker.schemas.job import SpecError
from opentinker.sdk import Client

from conftest import follow, submit_when_ready


async def test_an_inference_job_serves_the_openai_api_from_its_rollout_worker(services, nats_url, tiny_model, job_id):
    services.start("scheduler")
    services.start("envhost")
    services.start("learner", f"worker_id=l-{job_id}")
    services.start("rollout", "engine=hf", f"worker_id=r-{job_id}")
    async with await Client.connect(nats_url) as client:
        # a trained policy to serve: one LoRA step
        train = await submit_when_ready(client, {
            "name": "tr", "model": tiny_model, "env": "arith", "engine": "hf", "steps": 1, "lora_rank": 8,
            "lora_alpha": 16, "lr": 1e-2, "prompts_per_step": 2, "group_size": 2, "checkpoint_every": 100,
            "sampling": {"max_new_tokens": 8, "max_total_tokens": 256}}, f"{job_id}-t")
        await follow(train, 300, services)
        assert (await train.wait(timeout_s=60)).state == JobState.COMPLETED

        base = await client.submit_inference_job(model=tiny_model, engine="hf", job_id=f"{job_id}-b")
        tuned = await client.submit_inference_job(model=tiny_model, engine="hf", policy_of=train.id,
                                                  job_id=f"{job_id}-p")
        rec = await base.job.record()
        assert rec.state == JobState.RUNNING and rec.placement.rollout == [f"r-{job_id}"]
        assert base.url.startswith("http://127.0.0.1:") and base.url.endswith(f"/jobs/{base.id}/v1")
        assert base.token and base.token not in rec.endpoint_token_sha256

        oai = openai.AsyncOpenAI(base_url=base.url, api_key=base.token, max_retries=0)
        models = await oai.models.list()
        assert [m.id for m in models.data] == [tiny_model]
        chat = await oai.chat.completions.create(
            model=base.model, messages=[{"role": "user", "content": "What is 2 + 3?"}],
            max_tokens=6, temperature=0)
        assert isinstance(chat.choices[0].message.content, str)
        assert 1 <= chat.usage.completion_tokens <= 6 and chat.usage.prompt_tokens > 5
        assert chat.system_fingerprint == "opentinker-v0"  # the base model
        again = await oai.chat.completions.create(
            model=base.model, messages=[{"role": "user", "content": "What is 2 + 3?"}],
            max_tokens=6, temperature=0)
        assert again.choices[0].message.content == chat.choices[0].message.content  # greedy
        comp = await oai.completions.create(model=base.model, prompt="1 + 1 =", max_tokens=4, temperature=0)
        assert 1 <= comp.usage.completion_tokens <= 4
        # OpenAI's `seed`: at temperature 1 the same seed returns the same completion, other seeds others
        seeded = [(await oai.completions.create(model=base.model, prompt="1 + 1 =", max_tokens=8, temperature=1.0,
                                                seed=s)).choices[0].text for s in (3, 3, 4, 5, -1, -1)]
        assert seeded[0] == seeded[1] and seeded[4] == seeded[5] and len(set(seeded[1:5])) >= 3, seeded

        served = openai.AsyncOpenAI(base_url=tuned.url, api_key=tuned.token, max_retries=0)
        chat = await served.chat.completions.create(
            model=tuned.model, messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=6, temperature=0)
        assert chat.system_fingerprint == "opentinker-v1"  # the trained job's policy

        # a wrong token, a token of another job, a request the endpoint does not do
        with pytest.raises(openai.AuthenticationError, match="wrong endpoint token"):
            await openai.AsyncOpenAI(base_url=base.url, api_key="otj-wrong", max_retries=0).models.list()
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=tuned.url, api_key=base.token, max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError, match="no inference job"):
            await openai.AsyncOpenAI(base_url=base.url.replace(base.id, train.id), api_key=base.token,
                                     max_retries=0).models.list()
        with pytest.raises(openai.UnprocessableEntityError, match="n"):
            await oai.chat.completions.create(model=base.model, messages=[{"role": "user", "content": "hi"}], n=2)

        with pytest.raises(SpecError, match="no job"):
            await client.submit_inference_job(model=tiny_model, policy_of="no-such-job")

        # cancelled: the endpoint stops serving it
        await base.cancel()
        with pytest.raises(openai.NotFoundError, match="cancelled"):
            await oai.models.list()
        await tuned.cancel()
