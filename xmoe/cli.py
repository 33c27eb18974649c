"""The `xmoe` command. Each subcommand lives with its stage; this file only wires them up."""
import argparse
import logging
import sys

from . import __version__


def _demo(args) -> int:
    """Quantize a random weight at each K and print the relative error: the codec end to end."""
    import time

    import torch

    from .format import decode_weight
    from .quant import quantize_linear

    torch.manual_seed(args.seed)
    w = torch.randn(args.out_features, args.in_features) / args.in_features ** 0.5
    print(f"EXL3 codec demo: weight {tuple(w.shape)}, codebook {args.codebook}, encoder {args.encoder}")
    print(f"{'K':>3} {'bytes':>10} {'rel. error':>11} {'seconds':>8}")
    for K in args.bits:
        t0 = time.perf_counter()
        tensors = quantize_linear(w, K, args.codebook, args.encoder, seed=args.seed)
        w_hat = decode_weight(tensors)[: w.shape[1], : w.shape[0]].T
        err = float((w_hat - w).pow(2).sum() / w.pow(2).sum())
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        print(f"{K:>3} {size:>10} {err:>11.5f} {time.perf_counter() - t0:>8.2f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xmoe", description="Giant MoE models at ~2 bits per weight (EXL3).")
    p.add_argument("--version", action="version", version=f"xmoe {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log decisions (backends, progress)")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="quantize and decode a random layer at several bit widths")
    d.add_argument("--bits", type=float, nargs="+", default=[2, 3, 4])
    d.add_argument("--codebook", default="mcg", choices=["3inst", "mcg", "mul1"])
    d.add_argument("--encoder", default="beam", choices=["viterbi", "beam"])
    d.add_argument("--in-features", type=int, default=512)
    d.add_argument("--out-features", type=int, default=384)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
