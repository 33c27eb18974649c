"""`xmoe quantize` speed on one GPU at DeepSeek-V4.1 expert shapes, against exllamav3's encoder in the
same run, and the projected time for a whole V4.1 pack; plus an interop check: a small pack written by
`xmoe quantize` decodes identically under exllamav3's `reconstruct`.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "quant"))
from benchmarks.encode import FLAGS, stock_encode  # noqa: E402
from benchmarks.stock import load_stock  # noqa: E402
from xmoe.format import decode_inner, matrix_to_tiles  # noqa: E402
from xmoe.quant import quantize_linear  # noqa: E402
from xmoe.quant.viterbi_triton import viterbi_triton  # noqa: E402

V41_TENSORS = 46_080  # 40 MoE layers x 384 experts x 3 projections
SHAPES = {"gate/up 5120->2304": (2304, 5120), "down 2304->5120": (5120, 2304)}


def sync_time(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def speed(ext, K: int, codebook: str) -> list[dict]:
    rows = []
    for name, (out, inp) in SHAPES.items():
        w = torch.randn(out, inp, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 0.01
        quantize_linear(w[:256, :256], K, codebook)  # compile
        _, t_full = sync_time(lambda: quantize_linear(w, K, codebook))
        tiles = matrix_to_tiles(torch.randn(inp, out, device="cuda") * 1.24)
        _, t_ours = sync_time(lambda: viterbi_triton(tiles, K, codebook))
        stock_encode(ext, tiles[:256].contiguous(), K, codebook)
        _, t_stock = sync_time(lambda: stock_encode(ext, tiles, K, codebook))
        rows.append({"shape": name, "tiles": tiles.shape[0], "xmoe_quantize_linear_s": t_full,
                     "xmoe_encoder_s": t_ours, "stock_encoder_s": t_stock})
    return rows


def interop(ext, tmp: Path) -> dict:
    from checkpoints import save_hf
    from safetensors import safe_open

    from xmoe.quant.convert import convert
    from xmoe.quant.plan import INDEX, ConvertOptions

    src = save_hf("olmoe", tmp / "src")
    convert(src, tmp / "dst", ConvertOptions(bits=2, codebook="mcg"), ["cuda:0"])
    index = json.loads((tmp / "dst" / INDEX).read_text())["weight_map"]
    same = 0
    keys = sorted(k[: -len(".trellis")] for k in index if k.endswith(".trellis"))
    for key in keys:
        with safe_open(str(tmp / "dst" / index[key + ".trellis"]), framework="pt", device="cuda:0") as f:
            trellis = f.get_tensor(key + ".trellis")
        theirs = torch.empty(trellis.shape[0] * 16, trellis.shape[1] * 16, dtype=torch.half, device="cuda")
        ext.reconstruct(theirs, trellis, 2.0, *FLAGS["mcg"])
        same += torch.equal(theirs, decode_inner(trellis, 2, "mcg"))
    return {"modules": len(keys), "identical": same}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ext = load_stock()
    report = {"gpu": torch.cuda.get_device_name(), "speed": speed(ext, 2, "mcg")}
    print(f"{'K=2 mcg':<20} {'tiles':>7} {'xmoe quantize_linear':>21} {'xmoe encoder':>13} {'stock encoder':>14}")
    for r in report["speed"]:
        print(f"{r['shape']:<20} {r['tiles']:>7} {r['xmoe_quantize_linear_s']:>20.2f}s {r['xmoe_encoder_s']:>12.2f}s "
              f"{r['stock_encoder_s']:>13.2f}s")
    per = {k: sum(r[k] for r in report["speed"]) / len(report["speed"]) for k in report["speed"][0] if k.endswith("_s")}
    report["projected_hours_one_gpu"] = {k: v * V41_TENSORS / 3600 for k, v in per.items()}
    print("projected hours for 46,080 V4.1 expert tensors on one GPU:",
          ", ".join(f"{k} {v:.1f} h" for k, v in report["projected_hours_one_gpu"].items()))
    with tempfile.TemporaryDirectory() as tmp:
        report["interop"] = interop(ext, Path(tmp))
    print(f"interop: {report['interop']['identical']}/{report['interop']['modules']} expert modules of an xmoe "
          "pack decode identically under exllamav3's reconstruct")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
