"""`xmoe quantize`: re-encode a checkpoint's routed experts as EXL3, streaming, resumable and parallel.

Phase 1 quantizes every expert projection into its own small file under DST/.xmoe-partial/parts (written
atomically, so a killed run keeps every finished expert). Phase 2 streams each output shard: pass-through
tensors are copied byte for byte in bounded chunks, EXL3 tensors come from the part files. Index, config and
report are written last; a directory with config.json is complete.
"""
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from .. import __version__
from ..format.config import QuantConfig
from ..format.layer import load_layer
from .calibrated import allocate_bits, quantize_calibrated
from .jobs import Job, Workers, expert_seed, load_expert, part_metadata, read_expert  # noqa: F401 (API)
from .plan import INDEX, SKIP_FILES, ConvertOptions, Plan, make_plan, shard_layout
from .st_io import CheckpointError, ShardWriter, copy_chunks, tensor_bytes

PARTIAL = ".xmoe-partial"
REPORT = "xmoe-quantize-report.json"


def run_jobs(plan: Plan, opts: ConvertOptions, workers: Workers, parts: Path, bar, finished) -> None:
    """Encode every expert whose part file is missing (the uncalibrated path)."""
    shard_of = {t.name: s for s, ts in plan.shards.items() for t in ts}
    todo = [p for p in plan.experts if not (parts / f"{p.key}.safetensors").exists()]
    bar.update(len(plan.experts) - len(todo))
    workers.run([Job(plan.src, shard_of[p.source], p, opts, parts / f"{p.key}.safetensors", K=plan.bits[p.key])
                 for p in todo], finished)


def progress(total: int):
    """A tensor progress bar with the source-weight throughput, and the callback that advances it."""
    bar = tqdm(total=total, unit="tensor", desc="quantize", dynamic_ncols=True)
    t0, nbytes = time.perf_counter(), 0

    def finished(entry):
        nonlocal nbytes
        nbytes += entry["bytes_in"]
        bar.set_postfix_str(f"{nbytes / 1e6 / (time.perf_counter() - t0):.1f} MB/s of source weights")
        if "curve" not in entry:
            bar.update()
    return bar, finished


def write_shard(plan: Plan, dst: Path, shard: str, items: list, parts: Path) -> None:
    entries = [e for item in items for e in ([(item[1].name, item[1].dtype, item[1].shape)]
                                            if item[0] == "copy" else item[2])]
    with ShardWriter(dst / shard, entries, metadata={"format": "pt"}) as out:
        for item in items:
            if item[0] == "copy":
                out.write(item[1].name, copy_chunks(plan.src / shard, item[1]))
                continue
            part = parts / f"{item[1]}.safetensors"
            tensors = load_layer(part, item[1])
            for name, _, _ in item[2]:
                out.write(name, [tensor_bytes(tensors[name.rsplit(".", 1)[1]])])


def finish(plan: Plan, dst: Path, opts: ConvertOptions, layout: dict, report: dict) -> None:
    """Non-tensor files, index, report, then config.json last (its presence marks a complete directory)."""
    for f in sorted(plan.src.iterdir()):
        if f.is_file() and not f.name.endswith(SKIP_FILES) and f.name not in ("config.json", INDEX):
            _atomic_copy(f, dst / f.name)
    weight_map, total = {}, 0
    for shard, items in layout.items():
        for item in items:
            names = [item[1].name] if item[0] == "copy" else [e[0] for e in item[2]]
            weight_map.update({n: shard for n in names})
        total += (dst / shard).stat().st_size
    _atomic_write(dst / INDEX, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _atomic_write(dst / REPORT, report)
    config = dict(plan.config)
    previous = config.pop("quantization_config", None)
    ks = sorted(set(plan.bits.values()))
    numel = {k: out * inp for k, (out, inp) in plan.shapes.items()}
    bits = sum(plan.bits[k] * n for k, n in numel.items()) / max(sum(numel.values()), 1) if numel else opts.bits
    layer_bits = {g["group"]: g["K"] for g in report["allocation"]["groups"]} if "allocation" in report else \
        {p: K for p, K in opts.bits_for}
    qc = QuantConfig(bits=round(bits, 2), codebook=opts.codebook, version=__version__,
                     layer_bits=layer_bits if len(ks) > 1 else {}, original_quantization_config=previous)
    config["quantization_config"] = qc.to_dict() | {"scope": "routed_experts", "encoder": opts.encoder}
    _atomic_write(dst / "config.json", config)


def _atomic_write(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _atomic_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def convert(src: str | os.PathLike, dst: str | os.PathLike, opts: ConvertOptions, devices: list[str],
            ray_address: str | None = None) -> dict:
    """Run (or resume) a conversion; returns the report. With `ray_address` ("local" starts a local
    cluster) the expert jobs run as Ray tasks, one GPU each where `devices` are GPUs."""
    src, dst = Path(src), Path(dst)
    if (dst / "config.json").exists():
        raise CheckpointError(f"{dst}: already holds a finished model (config.json); choose another DST")
    t0 = time.perf_counter()
    plan = make_plan(src, opts)
    tokens = None
    if opts.calibrate:
        from .calib_data import load_tokens
        tokens = load_tokens(src, opts.calibration, opts.calib_rows, opts.calib_cols)
    work, parts = dst / PARTIAL, dst / PARTIAL / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    stamp, fingerprint = work / "plan.json", plan.fingerprint(opts, "" if tokens is None else tokens.digest)
    if stamp.exists() and json.loads(stamp.read_text())["fingerprint"] != fingerprint:
        raise CheckpointError(f"{dst}: holds an unfinished conversion of another source or with other options; "
                              f"remove {work} or choose another DST")
    _atomic_write(stamp, {"fingerprint": fingerprint, "options": asdict(opts)})
    report = {"source": str(src), "options": asdict(opts), "devices": devices, "experts": len(plan.experts)}
    with Workers(devices, ray_address) as workers:
        if opts.allocates:
            report["allocation"] = allocate_bits(plan, opts, workers, work, tokens, devices)
        bar, finished = progress(len(plan.experts))
        log: list = []
        done = lambda entry: (log.append(entry), finished(entry))  # noqa: E731
        if tokens is not None:
            report["calibration"] = quantize_calibrated(plan, opts, workers, work, tokens, devices, bar, done)
        else:
            run_jobs(plan, opts, workers, parts, bar, done)
        bar.close()
    layout = shard_layout(plan, opts.codebook)
    for shard, items in tqdm(layout.items(), desc="write shards", unit="shard", dynamic_ncols=True):
        if not (dst / shard).exists():
            write_shard(plan, dst, shard, items, parts)
    entries = [{"key": p.key, "K": plan.bits[p.key], **part_metadata(parts / f"{p.key}.safetensors")}
               for p in plan.experts]
    report.update({"seconds": time.perf_counter() - t0,
                   "seconds_this_run_quantizing": sum(e["seconds"] for e in log if "curve" not in e),
                   "tensors": sorted(entries, key=lambda r: -r["rel_err"])})
    finish(plan, dst, opts, layout, report)
    shutil.rmtree(work)
    return report
