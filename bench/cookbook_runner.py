"""One tinker-cookbook recipe, run unchanged against a Tinker API, its datasets read from
local files and every HTTP call the SDK makes recorded. bench/cookbook_recipes.py runs it
in the cookbook's own virtualenv (it imports the cookbook and the `tinker` SDK, never
OpenTinker):

    <cookbook venv>/bin/python bench/cookbook_runner.py RECIPE CALLS.jsonl [key=value ...]

RECIPE is rl_loop, math_rl or on_policy_distillation; the key=value arguments go to the
recipe's own command line (chz), as `python -m <its module> key=value ...` would take them.
Environment: TINKER_BASE_URL and TINKER_API_KEY (the SDK's), GSM8K_DIR (a folder with
GSM8K's train.jsonl and test.jsonl), COOKBOOK_RENDERER (the renderer for a model the
cookbook does not know, default `role_colon`, its generic one); set HF_HUB_OFFLINE=1.

What is patched, in this process only (the cookbook's files are not touched):
- `datasets.load_dataset`: "openai/gsm8k" (rl_loop, math_rl's gsm8k env) reads GSM8K_DIR;
  "zwhe99/DeepMath-103K" (on-policy distillation's default prompts) reads GSM8K_DIR's
  questions; any other dataset raises, so nothing is fetched from the hub.
- `model_info.get_recommended_renderer_name`: for a model not in the cookbook's registry
  (a local folder), COOKBOOK_RENDERER instead of an error (rl_loop has no renderer option).
- `httpx.AsyncClient.send` / `httpx.Client.send`: each call appends a JSON line to
  CALLS.jsonl: time, method, path, status (null: no answer, `error` says why), for a
  4xx/5xx its body's first 500 characters (`detail`), for a forward(_backward) its
  loss_fn, datum count and how many datums carry provenance, and for a retrieve_future
  that answers a failed future its error (`future_error`).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time

MODULES = {"rl_loop": "tinker_cookbook.recipes.rl_loop",
           "math_rl": "tinker_cookbook.recipes.math_rl.train",
           "on_policy_distillation": "tinker_cookbook.recipes.distillation.on_policy_distillation"}


def record_http(path: str) -> None:
    """Append every httpx call's outcome to `path` (module docstring)."""
    import httpx

    out = open(path, "a", buffering=1)

    def note(request, response, error: str = "") -> None:
        row = {"t": round(time.time(), 3), "method": request.method, "path": request.url.path,
               "status": response.status_code if response is not None else None}
        if error:
            row["error"] = error[:500]
        if request.url.path.endswith(("/forward_backward", "/forward")):
            row.update(_forward_backward(request))
        if response is not None and response.status_code >= 400:
            row["detail"] = response.text[:500]
        if response is not None and request.url.path.endswith("/retrieve_future") \
                and response.headers.get("content-type", "").startswith("application/json"):
            body = response.json()
            if isinstance(body, dict) and body.get("error"):
                row["future_error"] = str(body["error"])[:500]
        out.write(json.dumps(row) + "\n")

    original_async, original_sync = httpx.AsyncClient.send, httpx.Client.send

    async def send_async(self, request, *args, **kwargs):
        try:
            response = await original_async(self, request, *args, **kwargs)
        except Exception as e:
            note(request, None, f"{type(e).__name__}: {e}")
            raise
        if response.status_code >= 400 or request.url.path.endswith("/retrieve_future"):
            await response.aread()
        note(request, response)
        return response

    def send_sync(self, request, *args, **kwargs):
        try:
            response = original_sync(self, request, *args, **kwargs)
        except Exception as e:
            note(request, None, f"{type(e).__name__}: {e}")
            raise
        if response.status_code >= 400 or request.url.path.endswith("/retrieve_future"):
            response.read()
        note(request, response)
        return response

    httpx.AsyncClient.send, httpx.Client.send = send_async, send_sync


def _forward_backward(request) -> dict:
    """loss_fn, datums and datums with provenance of a forward(_backward) request body."""
    from tinker.proto import tinker_public_pb2 as pb

    body = request.content
    if request.headers.get("content-encoding", "").lower() == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=64 * 1024 * 1024)
    req = pb.ForwardBackwardRequest()
    try:
        req.ParseFromString(body)
    except Exception as e:  # not ours to judge: the server answers it
        return {"body_error": str(e)[:200]}
    return {"loss_fn": req.loss_fn, "datums": len(req.data),
            "with_provenance": sum(1 for d in req.data if len(d.loss_fn_input_spans))}


def local_datasets(gsm8k_dir: str) -> None:
    """`datasets.load_dataset` reads local files only (module docstring)."""
    import datasets

    original = datasets.load_dataset
    files = {"train": os.path.join(gsm8k_dir, "train.jsonl"), "test": os.path.join(gsm8k_dir, "test.jsonl")}

    def load_dataset(path, name=None, split=None, **kwargs):
        if path in ("openai/gsm8k", "zwhe99/DeepMath-103K"):
            ds = original("json", data_files=files)
            return ds[split] if split else ds
        raise RuntimeError(f"load_dataset({path!r}): this run reads local files only (GSM8K_DIR)")

    datasets.load_dataset = load_dataset


def generic_renderer(name: str) -> None:
    """The cookbook's recommended renderer, or `name` for a model it does not know."""
    from tinker_cookbook import model_info
    from tinker_cookbook.exceptions import ConfigurationError

    original = model_info.get_recommended_renderer_name

    def recommended(model_name: str) -> str:
        try:
            return original(model_name)
        except (ConfigurationError, KeyError, ValueError):
            return name

    model_info.get_recommended_renderer_name = recommended


def main(argv: list[str]) -> None:
    recipe, calls, args = argv[0], argv[1], argv[2:]
    if recipe not in MODULES:
        raise SystemExit(f"recipe: one of {', '.join(MODULES)}, got {recipe!r}")
    record_http(calls)
    local_datasets(os.environ["GSM8K_DIR"])
    generic_renderer(os.environ.get("COOKBOOK_RENDERER", "role_colon"))
    sys.argv = [MODULES[recipe], *args]
    runpy.run_module(MODULES[recipe], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
