"""`xmoe quantize` speed on one GPU at DeepSeek-V4.1 expert shapes, against exllamav3's encoder in the
same run, and the projected time for a whole V4.1 pack; plus an interop check: a small pack written by
`xmoe quantize` decodes identically under exllamav3's `reconstruct`. With --scaling, whole `xmoe quantize`
runs over a slice of V4.1-shaped experts on one GPU and on every visible GPU, wall-clock.
"""
import argparse
import json
import shutil
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


def v41_slice(path: Path, layers: int, experts: int, hidden: int = 5120, inter: int = 2304) -> Path:
    """A checkpoint of DeepSeek-V3 key names holding only routed experts at V4.1's shapes, a shard per layer."""
    from safetensors.torch import save_file

    from xmoe.quant.plan import INDEX

    path.mkdir(parents=True)
    gen, weight_map = torch.Generator().manual_seed(0), {}
    for layer in range(layers):
        shard, tensors = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors", {}
        for e in range(experts):
            for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
                weight_map[name] = shard
        save_file(tensors, str(path / shard), metadata={"format": "pt"})
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": hidden,
              "moe_intermediate_size": inter, "n_routed_experts": experts, "num_hidden_layers": layers}
    (path / "config.json").write_text(json.dumps(config))
    return path


def scaling(tmp: Path, layers: int, experts: int, device_sets: list[list[str]], **shape) -> list[dict]:
    """Wall-clock of whole `xmoe quantize` runs (K=2 MCG, Viterbi) on each set of devices, same source."""
    from xmoe.quant.convert import convert
    from xmoe.quant.plan import ConvertOptions

    src = v41_slice(tmp / "src", layers, experts, **shape)
    rows = []
    for devices in device_sets:
        dst = tmp / f"dst-{len(devices)}"
        t0 = time.perf_counter()
        report = convert(src, dst, ConvertOptions(bits=2, codebook="mcg", encoder="viterbi"), devices)
        rows.append({"devices": devices, "tensors": report["experts"], "seconds": time.perf_counter() - t0,
                     "worker_seconds": report["seconds_this_run_quantizing"]})
        shutil.rmtree(dst)
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
    ap.add_argument("--scaling", type=int, nargs=2, metavar=("LAYERS", "EXPERTS"),
                    help="also time whole runs over LAYERS x EXPERTS V4.1-shaped experts on 1 and on all GPUs")
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
    if args.scaling:
        gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        with tempfile.TemporaryDirectory() as tmp:
            report["scaling"] = scaling(Path(tmp), *args.scaling, [gpus[:1]] + ([gpus] if len(gpus) > 1 else []))
        base = report["scaling"][0]["seconds"]
        print(f"{'xmoe quantize, K=2 mcg':<24} {'tensors':>8} {'wall':>8} {'wall/tensor':>12} {'speedup':>8} "
              f"{'worker s/tensor':>16}")
        for r in report["scaling"]:
            print(f"{len(r['devices'])} GPU{'s' if len(r['devices']) > 1 else '':<20} {r['tensors']:>8} "
                  f"{r['seconds']:>7.1f}s {r['seconds'] / r['tensors']:>11.3f}s {base / r['seconds']:>7.2f}x "
                  f"{r['worker_seconds'] / r['tensors']:>15.3f}s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
