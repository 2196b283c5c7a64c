"""Policy weights for the rollout engines: decode a weight event's bytes, merge a LoRA
adapter into the base weights, and plan the tensors an engine must load to hold a
given policy.

Pure tensors in, tensors out (torch and safetensors only, no engine). Every tensor is
named by its Hugging Face parameter name (`model.layers.0.self_attn.q_proj.weight`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors

_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[A-Za-z0-9_-]+))?$")
_PEFT_PREFIX = "base_model.model."


class WeightsError(ValueError):
    """Weight bytes or an adapter that cannot be applied (bad uri, sha256 mismatch,
    malformed adapter, unknown parameter). The message names what is wrong."""


def parse_uri(uri: str) -> tuple[str, str, str]:
    """Split a weight uri into ("nats-os", bucket, object name) or ("file", "", path).

    Raises WeightsError for any other scheme or a uri without a bucket/object.
    """
    u = urlparse(uri)
    if u.scheme == "nats-os":
        name = unquote(u.path.lstrip("/"))
        if not u.netloc or not name:
            raise WeightsError(f"`uri`: {uri!r} must be nats-os://<bucket>/<object>")
        return "nats-os", u.netloc, name
    if u.scheme == "file":
        if not u.path:
            raise WeightsError(f"`uri`: {uri!r} names no file")
        return "file", "", unquote(u.path)
    raise WeightsError(f"`uri`: unsupported scheme in {uri!r} (expected nats-os:// or file://)")


def check_sha256(data: bytes, expected: str) -> None:
    """Raise WeightsError unless sha256(data) == expected (hex, case-insensitive)."""
    got = hashlib.sha256(data).hexdigest()
    if got != expected.lower():
        raise WeightsError(f"`sha256`: weights hash to {got}, the event says {expected}")


def decode_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """A safetensors file's bytes -> {name: tensor}. Raises WeightsError if malformed."""
    try:
        return load_safetensors(data)
    except SafetensorError as e:
        raise WeightsError(f"weights are not a safetensors file: {e}") from None


def lora_pairs(adapter: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Group a peft adapter state dict into {base weight name: (A [r, in], B [out, r])}.

    Accepts `get_peft_model_state_dict` output
    (`base_model.model.<module>.lora_A.weight`), keys that keep the adapter name
    (`...lora_A.default.weight`) and keys without `.weight`. Raises WeightsError for
    keys that are not LoRA A/B matrices (embedding adapters, modules_to_save) or an
    A without its B.
    """
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in adapter.items():
        k = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        k = k.removesuffix(".weight")
        m = _LORA_KEY.match(k)
        if m is None:
            raise WeightsError(f"adapter key {key!r} is not a LoRA A/B matrix")
        if t.ndim != 2:
            raise WeightsError(f"adapter key {key!r}: expected a 2-D matrix, got shape {tuple(t.shape)}")
        parts.setdefault(m["module"] + ".weight", {})[m["ab"]] = t
    out = {}
    for name, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise WeightsError(f"adapter for {name!r} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != b.shape[1]:
            raise WeightsError(f"adapter for {name!r}: A is {tuple(a.shape)}, B is {tuple(b.shape)}; ranks differ")
        out[name] = (a, b)
    return out


def merge_lora(base: Mapping[str, torch.Tensor],
               pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
               scale: float, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """W = W0 + scale * B @ A for every adapted weight, computed in float32 (W0
    upcast) on W0's device and rounded once: to `dtype`, the engine's, when given; else
    left in float32, for the engine's load to round into whatever it holds.

    base:  W0 by name ([out, in]); pairs: from `lora_pairs`; scale = lora_alpha / r
    (LoRA, arXiv 2106.09685 eq. 3 and §4.1). Starts from W0 every time, so merging
    version n+1 never compounds on version n. The result is not cast back to W0's
    dtype: under a float32 engine (vLLM reads W0 from the checkpoint, bfloat16 for most
    Hugging Face models) that cast rounded the sum to bfloat16 and lost an early update
    whose |scale B A| is below half of W0's bfloat16 spacing (relative error of the
    delta 0.86 at |B| ~ 1e-4, rank 8, |W0| ~ 0.016; now ~4e-5). An engine holding
    bfloat16 weights keeps that limit whatever the merge does, its W0 + delta being
    bfloat16: the adapter applied unmerged (vLLM multi-LoRA, `max_loras`) or a float32
    sampler keep such an update.
    Raises WeightsError for a name the base model lacks or a shape mismatch.
    """
    out = {}
    for name, (a, b) in pairs.items():
        w0 = base[name]
        if (b.shape[0], a.shape[1]) != tuple(w0.shape):
            raise WeightsError(f"adapter for {name!r} is {b.shape[0]}x{a.shape[1]}, "
                               f"the base weight is {tuple(w0.shape)}")
        # on W0's device: an engine whose weights live on the GPU merges there; one addmm
        # (W0 + scale * B @ A in a single pass, no temporaries of W0's size)
        merged = torch.addmm(w0.to(torch.float32), b.to(w0.device, torch.float32), a.to(w0.device, torch.float32),
                             alpha=scale)
        out[name] = merged if dtype is None else merged.to(dtype)
    return out


def lora_scale(lora_alpha: int, lora_rank: int, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> float:
    """lora_alpha / lora_rank; the rank falls back to the adapter's own when the event
    gives 0. Raises WeightsError if alpha is not positive."""
    rank = lora_rank or next((a.shape[0] for a, _ in pairs.values()), 0)
    if lora_alpha <= 0 or rank <= 0:
        raise WeightsError(f"`lora_alpha`/`lora_rank`: need both > 0 for a LoRA event, "
                           f"got alpha={lora_alpha} rank={rank}")
    return lora_alpha / rank


def write_peft_adapter(base: Mapping[str, torch.Tensor], pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                       lora_alpha: int, lora_rank: int, out_dir: Path) -> int:
    """Save an adapter as a peft folder (`adapter_config.json`,
    `adapter_model.safetensors`), the form vLLM's LoRARequest loads. Checks every pair
    against the base weight's shape; returns the rank. Raises WeightsError."""
    from safetensors.torch import save_file

    scale = lora_scale(lora_alpha, lora_rank, pairs)
    rank = next(a.shape[0] for a, _ in pairs.values())
    tensors = {}
    for name, (a, b) in pairs.items():
        if name not in base:
            raise WeightsError(f"adapter for {name!r}: the model has no such weight")
        if (b.shape[0], a.shape[1]) != tuple(base[name].shape):
            raise WeightsError(f"adapter for {name!r} is {b.shape[0]}x{a.shape[1]}, "
                               f"the base weight is {tuple(base[name].shape)}")
        module = name.removesuffix(".weight")
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    targets = sorted({n.removesuffix(".weight").rsplit(".", 1)[-1] for n in pairs})
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    # lora_alpha / r is the scale peft and vLLM apply (arXiv 2106.09685 §4.1)
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": _number(scale * rank),
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": ""}))
    return rank


def _number(x: float) -> int | float:
    return int(round(x)) if abs(x - round(x)) < 1e-9 else x


class BaseWeights(Mapping[str, torch.Tensor]):
    """The base model's tensors by Hugging Face name, read lazily from its safetensors
    files and cached, so each LoRA merge starts from W0 and a job switch can restore it.

    model: a local folder, or a hub id (its snapshot in the Hugging Face cache).
    Raises WeightsError when the model has no safetensors files or lacks a name.
    """

    def __init__(self, model: str):
        self.model = model
        self._where_cache: dict[str, str] | None = None
        self._cache: dict[str, torch.Tensor] = {}

    @property
    def _where(self) -> dict[str, str]:
        if self._where_cache is None:
            self._where_cache = _safetensors_index(self.model)
        return self._where_cache

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            if name not in self._where:
                raise WeightsError(f"the base model has no parameter {name!r}")
            with safe_open(self._where[name], "pt") as f:
                self._cache[name] = f.get_tensor(name)
        return self._cache[name]

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _safetensors_index(model: str) -> dict[str, str]:
    d = Path(model)
    if not d.is_dir():
        from huggingface_hub import snapshot_download

        d = Path(snapshot_download(model, allow_patterns=["*.safetensors", "*.json"]))
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = json.loads(index.read_text())["weight_map"]
        return {name: str(d / f) for name, f in files.items()}
    if (d / "model.safetensors").exists():
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return {name: str(d / "model.safetensors") for name in f.keys()}
    raise WeightsError(f"no safetensors weights in {model}")


def siblings(name: str, packed: Mapping[str, list[str]]) -> list[str]:
    """The other checkpoint tensors that an engine stores fused with `name`.

    `packed` is vLLM's `packed_modules_mapping`, e.g. {"qkv_proj": ["q_proj",
    "k_proj", "v_proj"]}: `...self_attn.q_proj.weight` -> [`...k_proj.weight`,
    `...v_proj.weight`].
    """
    parts = name.split(".")
    if len(parts) < 2:
        return []
    for group in packed.values():
        if parts[-2] in group:
            return [".".join(parts[:-2] + [g, parts[-1]]) for g in group if g != parts[-2]]
    return []


class HeldWeights:
    """What an engine holds beyond its base weights, and the load that moves it to
    another policy.

    The engine starts at base. `plan(new)` returns the tensors to load so that it
    holds base + `new`: the new tensors, the base value of anything changed before
    but not now (a LoRA job after a full-weights job, or another job's targets), and
    the current value of fused siblings (vLLM reloads a fused qkv_proj only when all
    three parts arrive). `commit(new)` records that the load happened.
    """

    def __init__(self, base: Mapping[str, torch.Tensor], packed: Mapping[str, list[str]] | None = None):
        self.base = base
        self.packed = dict(packed or {})
        self.changed: set[str] = set()

    def plan(self, new: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(new)
        for name in self.changed - new.keys():
            out[name] = self.base[name]
        for name in list(out):
            for sib in siblings(name, self.packed):
                if sib not in out:
                    out[sib] = new[sib] if sib in new else self.base[sib]
        return out

    def commit(self, new: Mapping[str, torch.Tensor]) -> None:
        self.changed = set(new)
