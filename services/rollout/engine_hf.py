"""The transformers engine: the light fallback (any causal LM transformers loads, CPU or
CUDA, any head_dim). Nothing but service.py imports this module.

Batched sampling with left padding and a KV cache. Each sampled token's logprob is
taken under the distribution it was sampled from, the same one vLLM reports with
logprobs_mode="processed_logprobs": logits / temperature, top-k filtered (Fan et al.
2018, arXiv 1805.04833), top-p filtered (nucleus sampling, Holtzman et al. 2019, arXiv
1904.09751 §3.1), renormalized.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from transformers import AutoTokenizer

from opentinker.schemas import SamplingParams
from opentinker.schemas.tinker import TOPK_MASK_LOGPROB
from opentinker.services.core.models import load_policy_model, load_processor, vision_inputs
from opentinker.services.rollout.agent_loop import GenOut, seeds_per_prompt

log = logging.getLogger("opentinker.rollout")

MAX_BATCH = 64  # rows per forward pass; bounds the KV cache on a small machine
DECODES = ("dynamic", "static", "compiled")
CACHE_BLOCK = 128  # a static cache's length is rounded up to a multiple of this
CACHES_KEPT = 4    # static caches kept (the most recently used shapes)


def resolve_decode(decode: str, device: str) -> str:
    """The decoding an HFEngine runs: "auto" is "compiled" on CUDA and "dynamic" on a
    CPU (where inductor's compile took minutes and CUDA graphs do not exist); any other
    value is itself. Raises ValueError for a name not in DECODES."""
    if decode == "auto":
        return "compiled" if str(device).startswith("cuda") else "dynamic"
    if decode not in DECODES:
        raise ValueError(f"`hf_decode`: {decode!r} is not one of auto, {', '.join(DECODES)}")
    return decode


def bucket(n: int) -> int:
    """The batch size a static-shape decode runs `n` rows at: the next power of two
    (at most MAX_BATCH), so a compiled decode meets a handful of shapes, not every n."""
    return min(1 << max(n - 1, 0).bit_length(), MAX_BATCH) if n <= MAX_BATCH else n


def stop_token_ids(generation_config, tokenizer) -> set[int]:
    """The ids that end a turn: generation_config's eos ids (a model's end-of-turn
    token, e.g. <|im_end|> or <|eot_id|>) plus the tokenizer's eos."""
    ids: set[int] = set()
    eos = getattr(generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None,
           generator: torch.Generator | None = None, top_k: torch.Tensor | None = None,
           uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return (token [B] int64, logprob [B] float32).

    Row i takes the token where its cumulative probability first exceeds a uniform draw
    u_i (inversion, Devroye 1986, "Non-Uniform Random Variate Generation" §2.1), every
    row at once: one cumulative sum over the batch's vocabulary (float64) and one search.
    uniforms: [B] float64 in [0, 1), the draws (a seeded request brings its own,
    per_request_uniforms, so its tokens do not depend on the rows beside it); None: B
    draws from `generator` (None: torch's default).
    logits: [B, V] float32; temperature, top_p: [B] (top_p None: 1 for every row); top_k:
    [B] int64 or None (k <= 0 keeps every token). A caller that knows no row filters
    passes None: each check of a tensor here is a wait for the device. A row with
    temperature 0 is greedy. The logprob is
    log softmax(logits / T) after top-k filtering (the k highest logits kept; ties at
    the k-th are kept too) and then top-p filtering (the smallest set of tokens whose
    probability mass reaches top_p is kept), as vLLM applies them.
    """
    greedy = temperature <= 0
    x = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    if top_k is not None and bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, x.shape[-1]).clamp(max=x.shape[-1])
        kth = x.topk(int(k.max()), -1).values.gather(-1, (k - 1)[:, None])  # the k-th largest, per row
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and bool((top_p < 1).any()):
        sorted_x, order = x.sort(-1, descending=True)
        probs = sorted_x.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop = mass_before >= top_p[:, None]
        drop[:, 0] = False
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    logp = x.log_softmax(-1)
    probs = logp.exp()
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    at = (uniforms.to(cdf) * cdf[:, -1])[:, None]  # the total, not 1: the float sum's own
    # right=True: the first token whose cdf exceeds the draw, never a zero-probability one
    sampled = torch.searchsorted(cdf, at, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)
    token = torch.where(greedy, logits.argmax(-1), sampled)
    return token, logp.gather(-1, token[:, None])[:, 0]


def per_request_uniforms(seeds: Sequence[int | None] | None, limits: Sequence[int],
                         shared: torch.Generator) -> torch.Tensor | None:
    """The draws of a seeded batch: [n, max(limits)] float64 in [0, 1) on the host, row i's
    first limits[i] (one a token) from a CPU generator seeded with seeds[i], or from
    `shared` (a CPU generator) where that seed is None; the rest 0.5, never read. A CPU
    generator's draws come in order, so a row's are a prefix of its seed's stream,
    whatever its limit or the rows beside it. None for no seeds. Raises ValueError unless
    one seed per prompt."""
    if seeds is None:
        return None
    out = torch.full((len(limits), max(limits)), 0.5, dtype=torch.float64)
    for i, (s, n) in enumerate(zip(seeds_per_prompt(seeds, len(limits)), limits)):
        g = shared if s is None else torch.Generator().manual_seed(s)
        out[i, :n] = torch.rand(n, generator=g, dtype=torch.float64)
    return out


class HFEngine:
    """A transformers causal LM (or vision-language model) that samples batches of
    token-id prompts.

    model: a path or hub id; device "cpu" or "cuda"; dtype a torch dtype name.
    Weights are loaded in place by Hugging Face parameter name (`load_weights`).
    `processor`: a vision-language model's processor (None for a text model); its
    prompts hold each image's placeholder tokens already expanded, and the images go
    to the prefill forward as pixel values.

    `decode` (resolve_decode): "dynamic" grows transformers' DynamicCache token by
    token; "static" decodes into a preallocated StaticCache, kept per (batch bucket,
    length) and reset between calls; "compiled" is static with the one-token decode
    forward under torch.compile(mode="reduce-overhead"): CUDA graphs replay the whole
    forward, as transformers' own generate does with cache_implementation="static"
    (its docs, "Static cache and torch.compile"). The prefill stays eager. The
    compile is paid once per shape bucket, at its first generate; weight loads copy
    into the same parameters in place, so the graphs stay valid across policy
    versions. A text model only: a vision model decodes dynamic.
    LoRA weights are merged where the weights live: `base_weights` hands out W0 on the
    engine's device and `merge_dtype` is the engine's dtype, so a LoRA version's load
    is the adapter's bytes plus one matmul per weight on the device, with no copy of
    the model through the host.
    """

    name = "hf"

    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 max_model_len: int = 2048, decode: str = "dynamic"):
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.processor = load_processor(model)
        self.model = load_policy_model(model, dtype=getattr(torch, dtype)).to(device)
        self.model.eval()
        self.device = torch.device(device)
        self.merge_dtype = self.model.dtype  # a merged LoRA weight is rounded once, to what the engine holds
        self.decode = "dynamic" if self.processor is not None else resolve_decode(decode, device)
        self._caches: dict[tuple[int, int], object] = {}  # (batch bucket, length) -> StaticCache
        self._decode_step = None  # the compiled one-token forward ("compiled")
        self._compiled_ok = False  # whether it has run a whole generation
        cfg = self.model.config.get_text_config()
        self.max_model_len = min(max_model_len, getattr(cfg, "max_position_embeddings", None) or max_model_len)
        self.stop_ids = stop_token_ids(self.model.generation_config, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.stop_ids)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.host_generator = torch.Generator().manual_seed(seed)  # unseeded rows of a seeded batch
        # no fused parameters: every checkpoint tensor loads on its own
        self.packed_modules: dict[str, list[str]] = {}
        self._w0: dict[str, torch.Tensor] = {}  # a parameter's loaded value, kept at its first change
        #: the weights as loaded, by the model's parameter names (the names the learner
        #: sends; a checkpoint may store them under older names, e.g. LLaVA's)
        self.base_weights: Mapping[str, torch.Tensor] = _LoadedWeights(self)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | Sequence[SamplingParams],
                 max_new_tokens: Sequence[int] | None = None,
                 images: Sequence[Sequence[bytes]] | None = None,
                 seeds: Sequence[int | None] | None = None) -> list[GenOut]:
        """Sample a completion for every prompt.

        prompts: token ids; sampling: one for all or one per prompt; max_new_tokens:
        an optional per-prompt cap below `sampling.max_new_tokens`; images: per prompt,
        its images (PNG/JPEG bytes) in placeholder order; seeds: per prompt, the seed of
        its own draws (per_request_uniforms: its completion is then a function of the
        seed, the prompt and the weights, whatever else is in the batch); None (all, or a
        prompt's): the engine's generator.
        Raises ValueError for a prompt that leaves no room under max_model_len, images
        for a text model, or seeds not one per prompt.
        """
        if not prompts:
            return []
        sps = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        caps = list(max_new_tokens) if max_new_tokens is not None else [s.max_new_tokens for s in sps]
        limits = [min(s.max_new_tokens, c, self.max_model_len - len(p)) for s, c, p in zip(sps, caps, prompts)]
        for i, n in enumerate(limits):
            if n < 1:
                raise ValueError(f"prompt {i} has {len(prompts[i])} tokens: no room under "
                                 f"max_model_len {self.max_model_len}")
        imgs = [list(x) for x in images] if images is not None else [[] for _ in prompts]
        draws = per_request_uniforms(seeds, limits, self.host_generator)
        out: list[GenOut] = []
        for at in range(0, len(prompts), MAX_BATCH):
            sl = slice(at, at + MAX_BATCH)
            args = (prompts[sl], sps[sl], limits[sl], [b for x in imgs[sl] for b in x],
                    None if draws is None else draws[sl])
            try:
                out += self._generate(*args)
            except Exception as e:  # noqa: BLE001 - the compile's own failure, whatever its type
                if self.decode != "compiled" or self._compiled_ok:
                    raise
                # a model or torch build the compile cannot take: decode eagerly instead
                log.warning("torch.compile of the decode step failed (%s: %s); decoding without it",
                            type(e).__name__, e)
                self.decode, self._decode_step = "static", None
                self._caches.clear()
                out += self._generate(*args)
            self._compiled_ok = self.decode == "compiled"
        return out

    def _vision(self, images: list[bytes]) -> dict[str, torch.Tensor]:
        """Pixel values (and the like) of `images` for the forward; {} for none."""
        return vision_inputs(self.processor, images, self.device, self.model.dtype)

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], sps: list[SamplingParams], limits: list[int],
                  images: list[bytes], draws: torch.Tensor | None = None) -> list[GenOut]:
        b, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        temp = torch.tensor([s.temperature for s in sps], dtype=torch.float32, device=self.device)
        top_p = torch.tensor([s.top_p for s in sps], dtype=torch.float32, device=self.device)
        top_k = torch.tensor([s.top_k for s in sps], dtype=torch.int64, device=self.device)
        nucleus, k_filter = any(s.top_p < 1 for s in sps), any(s.top_k > 0 for s in sps)

        static = self.decode != "dynamic"
        if static:  # padding rows up to the bucket: one prompt token each, never read
            rows = bucket(b)
            length = -(-(width + max(limits)) // CACHE_BLOCK) * CACHE_BLOCK
            cache = self._static_cache(rows, length)
            pad = rows - b
            ids = torch.cat([ids, ids.new_full((pad, width), self.pad_id)])
            attn = torch.cat([attn, attn.new_zeros((pad, width))])
            attn[b:, -1] = 1
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            full = attn.new_zeros((rows, length))  # the whole cache's mask, one fixed shape
            full[:, :width] = attn
            temp, top_p, top_k = (torch.cat([x, x[-1:].expand(pad)]) for x in (temp, top_p, top_k))
            if draws is not None:  # padding rows' draws: never read
                draws = torch.cat([draws, draws.new_full((pad, draws.shape[1]), 0.5)])
            step = self._decode_step or self.model
        # the images go to the prefill only: the KV cache holds them after it
        res = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1,
                         past_key_values=cache if static else None, **self._vision(images))
        if draws is not None:
            draws = draws.to(self.device)  # one transfer for the whole generation
        tokens: list[list[int]] = [[] for _ in range(b)]
        logprobs: list[list[float]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        live = [True] * b
        for n in range(max(limits)):
            tok, lp = sample(res.logits[:, -1].float(), temp, top_p if nucleus else None, self.generator,
                             top_k if k_filter else None, None if draws is None else draws[:, n])
            # one transfer from the device a step: ids are exact in float64
            toks, lps = torch.stack([tok[:b].double(), lp[:b].double()]).tolist()
            for i, (t, logp) in enumerate(zip(map(int, toks), lps)):
                if not live[i]:
                    continue
                tokens[i].append(t)
                logprobs[i].append(logp)
                if t in self.stop_ids:
                    live[i], reasons[i] = False, "stop"
                elif len(tokens[i]) >= limits[i]:
                    live[i] = False
            if not any(live):
                break
            pos = pos[:, -1:] + 1
            if static:
                full[:, width + n] = 1
                res = step(input_ids=tok[:, None], attention_mask=full, position_ids=pos,
                           past_key_values=cache, use_cache=True, logits_to_keep=1)
            else:
                attn = torch.cat([attn, attn.new_ones((b, 1))], dim=1)
                res = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                                 past_key_values=res.past_key_values, use_cache=True, logits_to_keep=1)
        return [GenOut(t, lps, r) for t, lps, r in zip(tokens, logprobs, reasons)]

    def _static_cache(self, rows: int, length: int):
        """The StaticCache of (rows, length), reset; made at first use and kept (its
        tensors keep their addresses, which CUDA graphs replay). The compiled decode
        forward is made with the first one."""
        from transformers import StaticCache

        cache = self._caches.pop((rows, length), None)
        if cache is None:
            while len(self._caches) >= CACHES_KEPT:
                self._caches.pop(next(iter(self._caches)))
            cache = StaticCache(config=self.model.config, max_cache_len=length)
        else:
            cache.reset()
        self._caches[(rows, length)] = cache  # last: the most recently used
        if self.decode == "compiled" and self._decode_step is None:
            # transformers' CompileConfig defaults: inductor, reduce-overhead, not fullgraph
            self._decode_step = torch.compile(self.model.forward, mode="reduce-overhead", dynamic=False)
        return cache

    @torch.inference_mode()
    def prompt_logprobs(self, prompts: list[list[int]],
                        images: Sequence[Sequence[bytes]] | None = None) -> list[list[float | None]]:
        """Score prompts under the current weights: element t of each list is
        log p(prompt[t] | prompt[:t]) in nats (the raw distribution), element 0 None
        (VLLMEngine.prompt_logprobs' contract). `images` as in generate. Raises
        ValueError for an empty prompt or one longer than max_model_len."""
        out: list[list[float | None]] = []
        for i, p in enumerate(prompts):
            if not p or len(p) > self.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens: need 1 to {self.max_model_len}")
            ids = torch.tensor([p], device=self.device)
            logits = self.model(input_ids=ids, **self._vision(list(images[i]) if images else [])).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append([None, *lp.tolist()])
        return out

    @torch.no_grad()
    def prompt_logprobs_topk(self, prompt: list[int], k: int) -> tuple[list[float | None], np.ndarray, np.ndarray]:
        """prompt_logprobs of one prompt, and at each position t >= 1 the k most likely
        tokens of p(. | prompt[:t]) (the raw distribution) and their logprobs, most
        likely first: (logprobs [L], ids [L, k] int32, logprobs [L, k] float32), row 0
        the sentinel (id 0, logprob -99999, Tinker's TopkLogprobs mask). Raises
        ValueError as prompt_logprobs does."""
        if not prompt or len(prompt) > self.max_model_len:
            raise ValueError(f"prompt has {len(prompt)} tokens: need 1 to {self.max_model_len}")
        ids = torch.tensor([prompt], device=self.device)
        lsm = torch.log_softmax(self.model(input_ids=ids).logits[0, :-1].float(), -1)
        lp = lsm.gather(-1, ids[0, 1:, None])[:, 0]
        top = lsm.topk(k, dim=-1)
        out_ids = np.zeros((len(prompt), k), np.int32)
        out_lps = np.full((len(prompt), k), TOPK_MASK_LOGPROB, np.float32)
        out_ids[1:] = top.indices.cpu().numpy()
        out_lps[1:] = top.values.cpu().numpy()
        return [None, *lp.tolist()], out_ids, out_lps

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy `tensors` (Hugging Face names) into the model in place.

        Raises ValueError naming an unknown parameter or a shape mismatch.
        """
        for name, t in tensors.items():
            try:
                p = self.model.get_parameter(name)
            except AttributeError:
                raise ValueError(f"model has no parameter {name!r}") from None
            if p.shape != t.shape:
                raise ValueError(f"parameter {name!r} is {tuple(p.shape)}, the update is {tuple(t.shape)}")
            if name not in self._w0:
                self._w0[name] = p.detach().clone()
            p.copy_(t)


class _LoadedWeights(Mapping[str, torch.Tensor]):
    """An HFEngine's weights as loaded (W0) by parameter name, on the engine's device:
    the value a parameter had before its first change, kept from the first time it is
    read here or loaded (a copy of each weight a policy changes, never of the rest)."""

    def __init__(self, engine: HFEngine):
        self.engine = engine

    def __getitem__(self, name: str) -> torch.Tensor:
        w0 = self.engine._w0
        if name not in w0:
            try:
                w0[name] = self.engine.model.get_parameter(name).detach().clone()
            except AttributeError:
                raise KeyError(name) from None
        return w0[name]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str) or name in self.engine._w0:
            return name in self.engine._w0
        try:
            self.engine.model.get_parameter(name)
            return True
        except AttributeError:
            return False

    def __iter__(self):
        return (n for n, _ in self.engine.model.named_parameters())

    def __len__(self) -> int:
        return sum(1 for _ in self.engine.model.named_parameters())
