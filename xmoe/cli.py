"""The `xmoe` command. Each subcommand lives with its stage; this file only wires them up."""
import argparse
import json
import logging
import os
import sys
from pathlib import Path

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


def _bits_rule(text: str) -> tuple[str, float]:
    pattern, _, k = text.rpartition("=")
    if not pattern:
        raise argparse.ArgumentTypeError(f"expected PATTERN=K, got {text!r}")
    return pattern, float(k)


def default_devices() -> list[str]:
    """Every GPU; without one, a single-threaded worker per core (one multi-threaded worker stalls on a
    busy machine)."""
    import torch
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"] * (os.cpu_count() or 1)


CALIBRATE_ON_GPUS = False


def _quantize(args) -> int:
    from .quant.convert import convert
    from .quant.plan import ConvertOptions

    devices = args.devices.split(",") if args.devices else default_devices()
    gpus = any(d.startswith("cuda") for d in devices)
    encoder = args.encoder or ("viterbi" if gpus else "beam")
    if args.calibrate is False and args.calibration:
        raise ValueError("--calibration names calibration text, but --no-calibrate was given")
    # Meant to be on by default on GPUs once the calibrated path has run on one (it has run only on CPUs); on the
    # CPU, where capture multiplies the build time, on request (or --calibration).
    calibrate = args.calibrate if args.calibrate is not None else ((gpus and CALIBRATE_ON_GPUS) or
                                                                   bool(args.calibration))
    if calibrate and args.calibrate is None and not args.calibration:
        from .quant.capture import capture_refusal
        from .quant.plan import read_source
        reason = capture_refusal(read_source(Path(args.src))[0])
        if reason:  # the default, not a request: say so and encode uncalibrated
            print(f"xmoe quantize: not calibrating ({reason}); --no-calibrate says so without this note")
            calibrate = False
    opts = ConvertOptions(bits=args.bits, codebook=args.codebook, encoder=encoder, bits_for=tuple(args.bits_for),
                          keep=tuple(args.keep), experts_regex=args.experts_regex, beam_width=args.beam_width,
                          seed=args.seed, calibrate=calibrate, calibration=args.calibration,
                          calib_rows=args.calibration_rows, calib_cols=args.calibration_cols,
                          calib_inputs=args.calibration_inputs, allocate=args.allocate)
    how = f"average {opts.bits:g} bits, allocated" if opts.allocates else f"K={opts.bits:g}"
    cal = f"calibrated ({opts.calib_rows} x {opts.calib_cols} tokens of {opts.calibration or 'the default mix'})" \
        if calibrate else "uncalibrated"
    print(f"quantize {args.src} -> {args.dst}: {how} {opts.codebook}, {cal}, encoder {encoder}, "
          f"devices {','.join(devices)}")
    report = convert(args.src, args.dst, opts, devices, args.ray)
    print_summary(report)
    print(f"report: {args.dst}/xmoe-quantize-report.json")
    return 0


def print_summary(report: dict) -> None:
    errs = [t["rel_err"] for t in report["tensors"]]
    print(f"\n{report['experts']} expert tensors in {report['seconds']:.1f} s; relative error mean "
          f"{sum(errs) / max(len(errs), 1):.4f}, worst {max(errs, default=0):.4f}")
    proxy = [t["proxy_err"] for t in report["tensors"] if "proxy_err" in t]
    fallback = [t for t in report["tensors"] if "fallback" in t]
    if proxy:
        print(f"output error over the calibration rows (proxy): mean {sum(proxy) / len(proxy):.4f}, "
              f"worst {max(proxy):.4f}")
    for t in fallback:
        print(f"uncalibrated fallback: {t['key']}: {t['fallback']}")
    if "allocation" in report:
        a = report["allocation"]
        mix: dict = {}
        for g in a["groups"]:
            mix[g["K"]] = mix.get(g["K"], 0) + g["numel"]
        total = sum(mix.values())
        print(f"bit allocation: {a['achieved_bits']:.4f} bits per weight (budget {a['bits']:g}): " +
              ", ".join(f"K={K:g} {100 * n / total:.1f}%" for K, n in sorted(mix.items())))
    print(f"{'worst tensors':<64} {'K':>4} {'rel_err':>8}")
    for t in report["tensors"][:5]:
        print(f"{t['key']:<64} {t['K']:>4g} {t['rel_err']:>8.4f}")


def _inspect(args) -> int:
    from .quant.inspect import inspect_dir, print_inspect

    info = inspect_dir(args.dir)
    print(json.dumps(info, indent=1, default=list) if args.json else "", end="")
    if not args.json:
        print_inspect(info)
    return 0


def _add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="re-encode a Hugging Face MoE checkpoint's routed experts as EXL3")
    q.add_argument("src", help="Hugging Face model directory (safetensors shards, config.json)")
    q.add_argument("dst", help="output directory (resumes an interrupted run)")
    q.add_argument("--bits", type=float, default=2,
                   help="K, bits per weight of routed experts (default 2); an average that is no K of the codebook "
                        "(e.g. 2.25) makes the bit allocator pick K per layer's gate/up and down")
    q.add_argument("--codebook", default="mcg", choices=["3inst", "mcg", "mul1"])
    q.add_argument("--encoder", choices=["viterbi", "beam"], help="default: viterbi on GPUs, beam on CPU")
    q.add_argument("--devices", help="comma-separated, e.g. cuda:0,cuda:1 or cpu,cpu (default: every GPU, else one "
                                     "cpu worker per core)")
    q.add_argument("--bits-for", type=_bits_rule, action="append", default=[], metavar="PATTERN=K",
                   help="K for expert modules whose key matches the regex PATTERN (first rule wins)")
    q.add_argument("--keep", action="append", default=[], metavar="PATTERN",
                   help="leave expert modules matching the regex at source precision")
    q.add_argument("--experts-regex", help="for unknown architectures: regex over tensor names with named "
                                           "groups layer, expert, proj")
    q.add_argument("--ray", metavar="ADDRESS", help="run expert jobs on a Ray cluster ('local' starts one; "
                                                   "needs the ray extra and SRC/DST on a shared filesystem)")
    q.add_argument("--allocate", action="store_true", help="pick K per group by measured error even when --bits is "
                                                             "a K (the average never exceeds --bits)")
    q.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                   help="encode against Hessians captured from calibration text (LDLQ); default: off "
                        "(on when --calibration is given)")
    q.add_argument("--calibration", metavar="FILE|DIR", help="calibration text (UTF-8; every file of DIR); default: "
                                                             "a mix of wiki, c4, code, multilingual and technical text")
    q.add_argument("--calibration-rows", type=int, default=250)
    q.add_argument("--calibration-cols", type=int, default=2048, help="tokens per calibration row")
    q.add_argument("--calibration-inputs", choices=["quantized", "original"], default="quantized",
                   help="each layer is calibrated on the states the layers before it produce as quantized "
                        "(default) or as they were")
    q.add_argument("--beam-width", type=int, default=64)
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(func=_quantize)


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

    _add_quantize_parser(sub)

    i = sub.add_parser("inspect", help="print what a model directory holds")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_inspect)

    from .serve.cli import add_serve_parser
    add_serve_parser(sub)
    from .serve.wheelhouse import add_wheelhouse_parser
    add_wheelhouse_parser(sub)

    from .bench.cli import add_bench, add_eval
    add_bench(sub)
    add_eval(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # `xmoe serve ... -- VLLM ARGS`
    parser = build_parser()
    args = parser.parse_args(argv[:len(argv) - len(extra) - 1] if "--" in argv else argv)
    if extra and args.command != "serve":
        parser.error(f"{args.command} takes no arguments after --")
    args.extra = extra
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input: one clear line, not a traceback
        print(f"xmoe {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
