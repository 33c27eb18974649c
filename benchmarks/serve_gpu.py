"""Whole-model serving speed on one GPU: a synthetic MoE with DeepSeek-V4.1's per-rank expert shapes, its
routed experts EXL3 (xmoe's kernels) against bf16 (vLLM's own fused MoE), both served by `xmoe serve`.

The model is GLM-4.5's architecture in vLLM (one unrouted shared expert beside the routed ones, GQA
attention) at hidden 5120, 384 routed experts of intermediate 1152 (a TP2 rank of V4.1's 2304), top-6, one
shared expert, and small attention (8 query heads, 1 KV head, 128 wide), so the MoE dominates the step as
in V4.1. Weights are random and made on the GPU (`--load-format dummy`; EXL3 experts at the pack's K and
codebook): the kernels' time does not depend on the stored values, and a 40-layer pack is timed without
writing 70 GB. Per variant it reports, from one server:
- decode tokens/s at 1, 4 and 16 streams and prefill tokens/s (`xmoe bench speed`);
- GPU memory of the loaded model (vLLM's own count) against the size of its tensors;
- where a decode step's time goes: a torch-profiler trace of captured steps, kernels summed by kind;
- with --soak SECONDS, the last variant under that many seconds of streaming clients: requests and failures.

    python benchmarks/serve_gpu.py --variant bf16:4 exl3:4 exl3:40 --json out.json
"""
import argparse
import gzip
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(hidden_size=5120, moe_intermediate_size=1152, intermediate_size=1152, n_routed_experts=384,
             num_experts_per_tok=6, n_shared_experts=1, num_attention_heads=8, num_key_value_heads=1, head_dim=128,
             vocab_size=32000)
# Kernel names by part of the step. Routed experts: xmoe's kernels, or vLLM's fused MoE for bf16. Routing: the
# top-k after the router's GEMM (a plain GEMV, counted with the rest).
EXPERT_KERNELS = re.compile(r"grouped_mma|grouped_gemv|route_rotate|act_epilogue|combine_|dense_gemm|decode_experts|"
                            r"fused_moe_kernel|moe_align|moe_sum|count_and_sort|act_and_mul", re.I)
ROUTING_KERNELS = re.compile(r"topk", re.I)
ATTENTION_KERNELS = re.compile(r"flash|fmha|attn|attention|reshape_and_cache", re.I)


def kind_of(kernel: str) -> str:
    for kind, pattern in (("experts", EXPERT_KERNELS), ("routing", ROUTING_KERNELS), ("attention", ATTENTION_KERNELS)):
        if pattern.search(kernel):
            return kind
    return "other"


def model_dir(root: Path, kind: str, layers: int, bits: float, max_len: int) -> Path:
    """config.json (GLM-4.5 architecture, V4.1's per-rank MoE shapes) and a word-level tokenizer."""
    from transformers import Glm4MoeConfig

    from xmoe.format import QuantConfig
    path = root / f"{kind}-{layers}"
    path.mkdir(parents=True, exist_ok=True)
    config = Glm4MoeConfig(**SHAPE, num_hidden_layers=layers, first_k_dense_replace=0, n_group=1, topk_group=1,
                           norm_topk_prob=True, partial_rotary_factor=0.5, max_position_embeddings=max_len,
                           tie_word_embeddings=False, torch_dtype="bfloat16").to_dict()
    config["architectures"] = ["Glm4MoeForCausalLM"]
    if kind == "exl3":
        config["quantization_config"] = QuantConfig(bits=bits, codebook="mcg", version="bench").to_dict()
    (path / "config.json").write_text(json.dumps(config, indent=1))
    word_tokenizer(path, SHAPE["vocab_size"], max_len)
    return path


def word_tokenizer(path: Path, vocab: int, max_len: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(cleanup=False)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "bos_token": "t1", "eos_token": "t2",
        "model_max_length": max_len, "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))


def tensor_bytes(kind: str, layers: int, bits: float) -> dict:
    """Bytes of the model's tensors: routed experts (EXL3: trellis + fp16 scales; bf16), and the rest."""
    s = SHAPE
    h, i, e = s["hidden_size"], s["moe_intermediate_size"], s["n_routed_experts"]
    if kind == "exl3":
        one = lambda k, n: k * n * bits / 8 + 2 * (k + n)  # noqa: E731 (trellis, suh, svh)
        experts = e * (2 * one(h, i) + one(i, h))
    else:
        experts = e * 3 * h * i * 2
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    per_layer = 2 * (h * (q + 2 * kv) + q * h + 3 * h * i * s["n_shared_experts"] + e * h + e + 2 * h)
    rest = layers * per_layer + 2 * (2 * s["vocab_size"] * h + h)
    return {"experts": layers * experts, "rest": rest, "total": layers * experts + rest}


def loaded_gib(log: str) -> float | None:
    m = re.search(r"Model loading took ([\d.]+) GiB", log)
    return float(m.group(1)) if m else None


def step_profile(trace_dir: Path, layers: int) -> dict:
    """Kernel time of the profiled decode steps by kind, per step: routed experts, routing, attention, the rest;
    and the wall time a step spans on the GPU (kernels plus the idle gaps between them, where the host is late).
    Steps are counted by the model's last kernel before sampling (the LM head GEMM's launch count is unreliable
    under graphs, so the count of the most frequent per-layer kernel / layers is used)."""
    files = sorted(trace_dir.rglob("*.json.gz")) + sorted(trace_dir.rglob("*.json"))
    worker = [f for f in files if "rank" in f.name or "worker" in f.name.lower()] or files
    if not worker:
        return {"error": f"no trace under {trace_dir}"}
    with (gzip.open if worker[-1].suffix == ".gz" else open)(worker[-1], "rt") as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    total = {"experts": 0.0, "routing": 0.0, "attention": 0.0, "other": 0.0}
    counts: dict[str, int] = {}
    for k in kernels:
        name = k["name"]
        total[kind_of(name)] += k["dur"]
        counts[name] = counts.get(name, 0) + 1
    per_layer = [c for n, c in counts.items() if ATTENTION_KERNELS.search(n)]
    steps = max(per_layer) // layers if per_layer else 0
    if not steps:
        return {"error": "no attention kernel in the trace: steps not countable", "kernels": len(kernels)}
    top = sorted(((sum(k["dur"] for k in kernels if k["name"] == n), n) for n in counts), reverse=True)[:12]
    # first kernel's start to last kernel's end: the steps' wall time, so (span - kernels) is the GPU's idle time
    span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    return {"steps": steps, **{f"{k}_us": v / steps for k, v in total.items()},
            "step_us": sum(total.values()) / steps, "span_us": span / steps,
            "experts_share": total["experts"] / max(sum(total.values()), 1e-9),
            "top_kernels_us_per_step": {n: d / steps for d, n in top}}


def serve(path: Path, name: str, work: Path, args) -> "Server":
    from xmoe.serve.options import ServeOptions
    from xmoe.serve.server import Server
    prof = work / f"trace-{name}"
    profiler = {"profiler": "torch", "torch_profiler_dir": str(prof), "torch_profiler_with_stack": False,
                "ignore_frontend": True}
    # no prefix caching: the synthetic word tokenizer reads any text as one repeated token, so every prompt would
    # be a cache hit and prefill would not be measured
    extra = ("--load-format", "dummy", "--gpu-memory-utilization", str(args.gpu_memory), "--no-enable-prefix-caching",
             "--profiler-config", json.dumps(profiler), *args.vllm_arg)
    opts = ServeOptions(path, served_model_name=name, port=args.port, max_model_len=args.max_len,
                        max_num_seqs=max(args.streams), dtype="bfloat16", eager=args.eager, extra_args=extra)
    return Server(opts, work / f"server-{name}.log", startup_timeout=1200)


def profile_decode(server, trace_dir: Path, tokens: int) -> None:
    """One request of `tokens` decode steps between /start_profile and /stop_profile."""
    import httpx
    from openai import OpenAI
    client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    httpx.post(server.url + "/start_profile", timeout=120).raise_for_status()
    client.completions.create(model=server.model, prompt="t5 t6 t7", max_tokens=tokens,
                              extra_body={"min_tokens": tokens, "ignore_eos": True})
    httpx.post(server.url + "/stop_profile", timeout=600).raise_for_status()
    deadline = time.time() + 120
    while time.time() < deadline and not list(trace_dir.rglob("*.json*")):
        time.sleep(1)


def measure(kind: str, layers: int, work: Path, args) -> dict:
    name = f"{kind}-{layers}"
    path = model_dir(work / "models", kind, layers, args.bits, args.max_len)
    row = {"variant": name, "layers": layers, "tensor_bytes": tensor_bytes(kind, layers, args.bits)}
    t0 = time.time()
    server = serve(path, name, work, args)
    with server:
        row["startup_s"] = round(time.time() - t0, 1)
        row["loaded_gib"] = loaded_gib(server.log_path.read_text(errors="replace"))
        if not args.soak_only:
            speed_and_profile(server, name, layers, row, work, args)
        if args.soak and is_last(args, kind, layers):
            from xmoe.serve.load import LoadOptions, run_load
            report = run_load(server.base_url, None, server.model, LoadOptions(clients=max(args.streams),
                                                                               seconds=args.soak, max_tokens=256))
            row["soak"] = {**report.summary(), "first_errors": [str(e) for e in report.errors[:10]]}
    return row


def speed_and_profile(server, name: str, layers: int, row: dict, work: Path, args) -> None:
    out = work / f"speed-{name}.json"
    cmd = [sys.executable, "-m", "xmoe", "bench", "speed", "--url", server.url, "--json", str(out),
           "--concurrency", *map(str, args.streams), "--prefill", *map(str, args.prefill),
           "--repeats", str(args.repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    row["speed"] = json.loads(out.read_text()) if out.exists() else {"error": done.stderr[-2000:]}
    if args.profile_tokens:
        trace = work / f"trace-{name}"
        profile_decode(server, trace, args.profile_tokens)
        row["profile"] = step_profile(trace, layers)


def is_last(args, kind: str, layers: int) -> bool:
    """The soak runs on the last variant asked for (the deepest pack, as the docstring's example orders them)."""
    return args.variant[-1] == f"{kind}:{layers}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", nargs="+", default=["bf16:4", "exl3:4"], help="KIND:LAYERS, KIND bf16 or exl3")
    p.add_argument("--bits", type=float, default=2, help="K of the EXL3 experts (MCG codebook)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--prefill", type=int, nargs="*", default=[2048, 16384])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-len", type=int, default=17408)
    p.add_argument("--gpu-memory", type=float, default=0.92, help="vLLM's --gpu-memory-utilization")
    p.add_argument("--profile-tokens", type=int, default=32, help="decode steps in the profile (0: none)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (for comparison only)")
    p.add_argument("--soak", type=float, default=0, help="seconds of streaming clients (as many as the most "
                   "streams) on the last variant; every failed request is reported")
    p.add_argument("--soak-only", action="store_true", help="the soak alone: no speed or profile (a server "
                   "that shares the GPU with other work)")
    p.add_argument("--vllm-arg", action="append", default=[], help="passed to vLLM as is")
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--work", type=Path, default=Path("/tmp/xmoe-serve-gpu"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = []
    for v in args.variant:
        kind, _, layers = v.partition(":")
        rows.append(measure(kind, int(layers), args.work, args))
        print(json.dumps(rows[-1], indent=1), flush=True)
        if args.json:  # after each variant: a later failure keeps what was measured
            args.json.write_text(json.dumps({"gpu": gpu_name(), **provenance(), "rows": rows}, indent=1))
    return 0


def provenance() -> dict:
    """The commit (XMOE_COMMIT, for a copy of the tree without .git, else git) and the date of the run."""
    import os
    commit = os.environ.get("XMOE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d"), **({"commit": commit} if commit else {})}


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"


if __name__ == "__main__":
    sys.exit(main())
