"""`xmoe inspect DIR`: what a model directory holds, by module group."""
import json
import re
from collections import defaultdict
from pathlib import Path

from ..format.layer import SUFFIXES
from .plan import read_source


def group_of(name: str) -> str:
    """Module key with every numeric index (layer, expert) replaced by *."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def inspect_dir(path: str | Path) -> dict:
    """Summary: quantization_config, size on disk, and per module group its format, K and bytes."""
    path = Path(path)
    config, shards = read_source(path)
    groups = defaultdict(lambda: {"format": set(), "bits": set(), "tensors": 0, "bytes": 0})
    mix = defaultdict(lambda: {"tensors": 0, "weights": 0, "modules": set()})  # K -> where it is used
    for infos in shards.values():
        for t in infos:
            module, _, suffix = t.name.rpartition(".")
            g = groups[group_of(module)]
            g["tensors"] += 1
            g["bytes"] += t.nbytes
            if suffix == "trellis":
                K = t.shape[-1] / 16
                g["format"].add("exl3")
                g["bits"].add(K)
                m = mix[K]
                m["tensors"] += 1
                m["weights"] += t.shape[0] * t.shape[1] * 256
                m["modules"].add(re.sub(r"\.\d+(?=\.[^.]+$)", ".*", module))  # the expert index collapsed
            elif suffix not in SUFFIXES or suffix == "bias":
                g["format"].add(t.dtype)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return {"path": str(path), "model_type": config.get("model_type"),
            "quantization_config": config.get("quantization_config"), "bytes_on_disk": size,
            "groups": {k: {**v, "format": sorted(v["format"]), "bits": sorted(v["bits"])}
                       for k, v in sorted(groups.items())},
            "bit_mix": {K: {**m, "modules": sorted(m["modules"])} for K, m in sorted(mix.items())}}


def print_inspect(info: dict) -> None:
    qc = info["quantization_config"] or {}
    print(f"{info['path']}: {info['model_type']}, {info['bytes_on_disk'] / 2**30:.3f} GiB on disk")
    if qc:
        print("quantization_config:", json.dumps(qc))
    print(f"{'module group':<60} {'format':<14} {'K':<8} {'tensors':>8} {'MiB':>10}")
    for name, g in info["groups"].items():
        bits = ",".join(f"{b:g}" for b in g["bits"]) or "-"
        print(f"{name:<60} {'/'.join(g['format']):<14} {bits:<8} {g['tensors']:>8} {g['bytes'] / 2**20:>10.2f}")
    mix = info["bit_mix"]
    if len(mix) > 1:  # a mixed pack: which modules (all experts of a layer's projection) got which K
        total = sum(m["weights"] for m in mix.values())
        print(f"bit mix: {sum(K * m['weights'] for K, m in mix.items()) / total:.4f} bits per EXL3 weight")
        for K, m in mix.items():
            print(f"  K={K:g}: {m['tensors']} tensors, {100 * m['weights'] / total:.1f}% of weights: "
                  f"{', '.join(m['modules'])}")
