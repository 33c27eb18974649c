"""Load run: N concurrent streaming chat clients for a bounded time against an OpenAI-compatible server.

    python benchmarks/serve_load.py --demo test --clients 32 --seconds 60    # starts the demo server itself
    python benchmarks/serve_load.py --base-url http://127.0.0.1:8000/v1 --model NAME --api-key KEY

Prints a table (and --json); exits 1 when any request failed.
"""
import argparse
import json
import secrets
import socket
import sys
import tempfile
from pathlib import Path

from xmoe.serve.load import LoadOptions, run_load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo_server(variant: str, log: Path):
    from xmoe.serve.demo import demo_model
    from xmoe.serve.options import ServeOptions, cuda_gpus, demo_defaults
    from xmoe.serve.server import Server
    options = ServeOptions(demo_model(variant), **demo_defaults(cuda_gpus()), port=free_port(),
                           api_key=secrets.token_hex(16))
    return Server(options, log)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="ends in /v1; without it the demo server is started")
    p.add_argument("--model", help="served model name (with --base-url)")
    p.add_argument("--api-key")
    p.add_argument("--demo", default="full", choices=["full", "test"])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    opts = LoadOptions(clients=args.clients, seconds=args.seconds, max_tokens=args.max_tokens)
    if args.base_url:
        if not args.model:
            p.error("--model is needed with --base-url")
        report = run_load(args.base_url, args.api_key, args.model, opts)
    else:
        with tempfile.TemporaryDirectory() as tmp, demo_server(args.demo, Path(tmp) / "server.log") as server:
            report = run_load(server.base_url, server.api_key, server.model, opts)
    summary = report.summary()
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:<18} {v}")
        for e in report.errors[:10]:
            print("error:", e)
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
