"""Images end to end below the bus, on a tiny random-init LLaVA made in the test: the
agent loop renders an env's images with the processor's chat template (each image's
placeholder expanded into the model's image tokens), the transformers engine samples
with the pixel values, and the learner's forward with the trajectory's images gives
back the sampler's logprobs (and different ones without them)."""

from __future__ import annotations

import io
import os

import pytest
import torch
from PIL import Image, ImageDraw

from opentinker.schemas import EnvInitReply, EnvResetReply, EnvStepReply, JobSpec, RolloutRequest, SamplingParams
from opentinker.services.rollout.agent_loop import AgentLoop


def png(shape: str, colour: str = "black") -> bytes:
    img = Image.new("RGB", (64, 64), "white")
    d = ImageDraw.Draw(img)
    if shape == "triangle":
        d.polygon([(8, 56), (56, 56), (8, 8)], outline=colour, width=3)
    else:
        d.ellipse((8, 8, 56, 56), outline=colour, width=3)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


TRIANGLE, CIRCLE = png("triangle"), png("circle", "red")


class DiagramGame:
    """A diagram with the first message, another with the first observation."""

    def __init__(self, user: str = "Find x."):
        self.user = user

    async def init(self, req):
        return EnvInitReply(state={})

    async def reset(self, req):
        return EnvResetReply(host_id="h", system_prompt="Answer briefly.", user_message=self.user, images=[TRIANGLE])

    async def step(self, host_id, req):
        return EnvStepReply(observation="Now this one.", images=[CIRCLE], done=False)

    async def close(self, host_id, req):
        pass


def request(n: int = 2) -> RolloutRequest:
    return RolloutRequest(job_id="j", request_id="r", step=0, group_index=0, group_seed=1, policy_version=0,
                          model="tiny-llava", env="diagram", group_size=n,
                          sampling=SamplingParams(max_new_tokens=5, max_turns=2, max_total_tokens=512))


async def v0() -> int:
    return 0


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm):
    from opentinker.services.rollout.engine_hf import HFEngine

    return HFEngine(tiny_vlm, seed=3)


def expected_ids(processor, messages, images) -> list[int]:
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images],
                    add_special_tokens=False)
    return list(enc["input_ids"][0])


async def test_images_reach_the_prompt_the_turns_and_the_trajectory(vlm_engine):
    proc = vlm_engine.processor
    image_id = vlm_engine.model.config.image_token_id
    [trajs] = await AgentLoop(vlm_engine, DiagramGame()).run([request()], v0)
    for t in trajs:
        assert not t.error, t.error
        assert t.images == [TRIANGLE, CIRCLE]
        assert [turn.images for turn in t.turns] == [1, 0]
        # the first prompt is the processor's rendering, the placeholder expanded (16 tokens)
        first = [{"role": "system", "content": "Answer briefly."},
                 {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]}]
        assert t.token_ids[:t.prompt_len] == expected_ids(proc, first, [TRIANGLE])
        assert t.token_ids[:t.prompt_len].count(image_id) == 16
        # the observation's image is in the observation span, not in a policy span
        turn = t.turns[0]
        assert t.token_ids[turn.gen_end:turn.obs_end].count(image_id) == 16
        assert all(t.loss_mask[i] == 0 for i, x in enumerate(t.token_ids) if x == image_id)
        assert t.token_ids.count(image_id) == 32


async def test_env_text_cannot_forge_image_placeholders(vlm_engine):
    image_id = vlm_engine.model.config.image_token_id
    [trajs] = await AgentLoop(vlm_engine, DiagramGame(user="<image><image> Find x.")).run([request(1)], v0)
    t = trajs[0]
    assert not t.error, t.error
    assert t.token_ids[:t.prompt_len].count(image_id) == 16  # its one image only


async def test_a_text_model_refuses_images_naming_why(tiny_model):
    from opentinker.services.rollout.engine_hf import HFEngine

    [trajs] = await AgentLoop(HFEngine(tiny_model), DiagramGame()).run([request(1)], v0)
    assert "images for a text model" in trajs[0].error and not trajs[0].token_ids


@pytest.fixture
def rank_env(monkeypatch):
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, os.environ.get(key, value))


async def test_the_learner_recomputes_the_sampler_logprobs_with_the_images(vlm_engine, tiny_vlm, rank_env):
    from opentinker.services.learner.batching import build_batch
    from opentinker.services.learner.engine_deepspeed import TrainEngine

    [trajs] = await AgentLoop(vlm_engine, DiagramGame()).run([request()], v0)
    eng = TrainEngine(JobSpec(lora_rank=4, micro_batch_size=2, prompts_per_step=1, group_size=2), tiny_vlm,
                      device="cpu")
    try:
        # LoRA stays on the language model: the vision tower and projector are frozen
        trainable = [n for n, p in eng.module.named_parameters() if p.requires_grad]
        assert trainable and all("language_model" in n for n in trainable)
        b = build_batch(trajs, [1.0, -1.0], eng.pad_id)
        assert b.images == (TRIANGLE, CIRCLE, TRIANGLE, CIRCLE)
        with torch.no_grad():
            got = eng._logprobs(eng.engine, b, 1.0)[0]
            blind = eng._logprobs(eng.engine, b._replace(images=(CIRCLE, TRIANGLE, CIRCLE, TRIANGLE)), 1.0)[0]
        keep = b.loss_mask > 0
        assert int(keep.sum()) > 0
        assert torch.allclose(got[keep], b.logprobs[keep], atol=1e-4), (got[keep] - b.logprobs[keep]).abs().max()
        # the images matter: swapped images give other logprobs
        assert (blind[keep] - b.logprobs[keep]).abs().max() > 1e-3
    finally:
        eng.close()
