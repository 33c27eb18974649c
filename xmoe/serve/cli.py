"""`xmoe serve` and `xmoe demo-model`: argument parsing; the work lives in options, launch, server, demo."""
import argparse
import os
import re
from pathlib import Path

UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "kib": 2 ** 10, "mib": 2 ** 20,
         "gib": 2 ** 30, "tib": 2 ** 40}
DEFAULTS = dict(host="127.0.0.1", port=8000, tensor_parallel_size=1, prefix_caching=True, eager=False,
                dtype="auto")


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m[2].lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 8GiB, 512MiB or 1073741824, got {text!r}")
    return int(float(m[1]) * UNITS[m[2].lower()])


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve a model (default: the demo model) on an OpenAI-compatible API",
                       epilog="Arguments after -- go to vLLM's server as they are.")
    s.add_argument("model", nargs="?", help="model directory; without it the demo model is built and served")
    s.add_argument("--demo", choices=["full", "test", "reference"], help="which demo model (default: full)")
    s.add_argument("--served-model-name")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int)
    s.add_argument("--max-model-len", type=int, help="max context length in tokens")
    s.add_argument("--kv-cache", dest="kv_cache_bytes", type=parse_bytes, help="KV-cache size, e.g. 40GiB")
    s.add_argument("--max-num-seqs", type=int, help="max concurrent sequences")
    s.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_const", const=False)
    s.add_argument("--speculative-method", help="drafter, e.g. mtp (the model's own multi-token predictor)")
    s.add_argument("--num-speculative-tokens", type=int)
    s.add_argument("--max-num-batched-tokens", type=int, help="chunked-prefill budget: tokens per engine step")
    s.add_argument("--eager", dest="eager", action="store_const", const=True, help="no CUDA graphs")
    s.add_argument("--cuda-graphs", dest="eager", action="store_const", const=False)
    s.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    s.add_argument("--cpu-threads", type=int, help="compute threads on vLLM's CPU backend")
    s.add_argument("--tool-call-parser", help="vLLM tool parser (e.g. hermes); enables automatic tool choice")
    s.add_argument("--api-key", help="required on every route but /health (default: $API_KEY)")
    s.add_argument("--shutdown-timeout", type=int, metavar="SECONDS",
                   help="on Ctrl-C, how long requests in flight may take to finish (default 10; 0: abort them)")
    s.add_argument("--dry-run", action="store_true", help="check and print the settings, do not start")
    s.set_defaults(func=run_serve)

    d = sub.add_parser("demo-model", help="build (once) the demo model and print its directory")
    d.add_argument("variant", nargs="?", default="full", choices=["full", "test", "reference"])
    d.set_defaults(func=run_demo_model)


def options_from_args(args, model: Path, demo: bool):
    from .options import ServeOptions, cuda_gpus, demo_defaults, machine_defaults
    names = ServeOptions.__dataclass_fields__.keys() - {"model", "api_key", "extra_args", "config"}
    given = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    gpus = cuda_gpus()
    values = {**DEFAULTS, **machine_defaults(gpus), **(demo_defaults(gpus) if demo else {}), **given}
    extra = getattr(args, "extra", [])
    return ServeOptions(model=model, api_key=args.api_key or os.environ.get("API_KEY") or None,
                        extra_args=tuple(extra), **values)


def run_serve(args) -> int:
    from .server import serve
    if args.model and args.demo:
        raise ValueError("give either MODEL or --demo, not both")
    if args.model:
        options = options_from_args(args, Path(args.model), demo=False)
    else:
        from .demo import demo_model, describe
        options = options_from_args(args, demo_model(args.demo or "full"), demo=True)
        print(f"xmoe demo: {describe(args.demo or 'full')}", flush=True)
    if args.dry_run:
        from .launch import describe
        print(describe(options))
        return 0
    serve(options)
    return 0  # not reached: serve() replaces this process


def run_demo_model(args) -> int:
    from .demo import demo_model
    print(demo_model(args.variant))
    return 0
