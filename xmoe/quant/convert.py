"""`xmoe quantize`: re-encode a checkpoint's routed experts as EXL3, streaming, resumable and parallel.

Phase 1 quantizes every expert projection into its own small file under DST/.xmoe-partial/parts (written
atomically, so a killed run keeps every finished expert). Phase 2 streams each output shard: pass-through
tensors are copied byte for byte in bounded chunks, EXL3 tensors come from the part files. Index, config and
report are written last; a directory with config.json is complete.
"""
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .. import __version__
from ..format.config import QuantConfig
from ..format.layer import decode_weight, load_layer, save_layers
from .experts import ExpertProj
from .linear import quantize_linear
from .plan import INDEX, SKIP_FILES, ConvertOptions, Plan, make_plan, shard_layout
from .source import dequantize
from .st_io import CheckpointError, ShardWriter, copy_chunks, tensor_bytes

PARTIAL = ".xmoe-partial"
REPORT = "xmoe-quantize-report.json"


def expert_seed(key: str, seed: int) -> int:
    """Per-tensor seed from its name: results do not depend on order, devices or restarts."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:4], "little")


def read_expert(src: Path, shard: str, p: ExpertProj) -> tuple:
    """The stored tensors of one expert projection (weight, scale or None), reading only their own bytes."""
    with safe_open(str(src / shard), framework="pt") as f:
        if p.rows is not None:
            weight = f.get_slice(p.source)[p.expert, p.rows[0]:p.rows[1]]
        else:
            weight = f.get_tensor(p.source)
        scale = f.get_tensor(p.scale) if p.scale else None
    return weight, scale


def load_expert(src: Path, shard: str, p: ExpertProj, device: str = "cpu", stored: tuple | None = None
                ) -> torch.Tensor:
    """fp32 (out, in) weight of one expert projection, dequantized on `device` (from `stored` when it was
    read ahead)."""
    weight, scale = stored or read_expert(src, shard, p)
    return dequantize(weight.to(device), None if scale is None else scale.to(device), p.source)


def quantize_part(src: Path, shard: str, p: ExpertProj, K: float, opts: ConvertOptions, device: str,
                  part: Path, stored: tuple | None = None) -> dict:
    """Quantize one projection to `part`; returns its report entry."""
    t0 = time.perf_counter()
    stored = stored or read_expert(src, shard, p)
    w = load_expert(src, shard, p, device, stored)
    t = quantize_linear(w, K, opts.codebook, opts.encoder, seed=expert_seed(p.key, opts.seed),
                        beam_width=opts.beam_width)
    w_hat = decode_weight({k: v.to(device) for k, v in t.items()})[: w.shape[1], : w.shape[0]].T
    err = float((w_hat - w).pow(2).sum() / w.pow(2).sum().clamp_min(1e-30))
    nbytes = sum(x.numel() * x.element_size() for x in stored if x is not None)
    entry = {"key": p.key, "K": K, "rel_err": err, "seconds": time.perf_counter() - t0, "bytes_in": nbytes}
    save_layers(part, {p.key: t}, metadata={"rel_err": repr(err)})
    return entry


def run_local(jobs: list, device: str, parts: Path, finished) -> None:
    """Jobs in order on one device, each one's source read by a thread while the one before is encoded."""
    if not jobs:
        return
    with ThreadPoolExecutor(1) as reader:
        ahead = reader.submit(read_expert, *jobs[0][:3])
        for i, job in enumerate(jobs):
            stored = ahead.result()
            if i + 1 < len(jobs):
                ahead = reader.submit(read_expert, *jobs[i + 1][:3])
            finished(quantize_part(*job, device, parts / f"{job[2].key}.safetensors", stored))


_device = None


def _init_worker(devices, threads):
    global _device
    _device = devices.get()
    if _device.startswith("cuda"):
        torch.cuda.set_device(_device)
    torch.set_num_threads(threads)  # CPU workers share the cores instead of oversubscribing them


def _run_in_worker(*args):
    return quantize_part(*args[:5], _device, args[5])


def _ray_part(*args):
    """A Ray task: quantize one projection on the GPU Ray assigned to it, else on the CPU."""
    return quantize_part(*args[:5], "cuda" if torch.cuda.is_available() else "cpu", args[5])


def run_ray(jobs: list, parts: Path, address: str, gpus: bool, finished) -> None:
    """Spread jobs over a Ray cluster (every node must see SRC and DST at the same paths)."""
    import ray

    ray.init(address=None if address == "local" else address, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}} if address == "local" else None)
    task = ray.remote(num_gpus=1 if gpus else 0, num_cpus=1)(_ray_part)
    pending = [task.remote(*job, parts / f"{job[2].key}.safetensors") for job in jobs]
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        finished(ray.get(ready[0]))


def run_jobs(plan: Plan, opts: ConvertOptions, devices: list[str], parts: Path, log: list,
             ray_address: str | None = None) -> None:
    shard_of = {t.name: s for s, ts in plan.shards.items() for t in ts}
    todo = [p for p in plan.experts if not (parts / f"{p.key}.safetensors").exists()]
    done_before = len(plan.experts) - len(todo)
    bar = tqdm(total=len(plan.experts), initial=done_before, unit="tensor", desc="quantize", dynamic_ncols=True)
    t0, nbytes = time.perf_counter(), 0

    def finished(entry):
        nonlocal nbytes
        log.append(entry)
        nbytes += entry["bytes_in"]
        bar.set_postfix_str(f"{nbytes / 1e6 / (time.perf_counter() - t0):.1f} MB/s of source weights")
        bar.update()

    jobs = [(plan.src, shard_of[p.source], p, plan.bits[p.key], opts) for p in todo]
    if ray_address:
        run_ray(jobs, parts, ray_address, any(d.startswith("cuda") for d in devices), finished)
    elif len(devices) == 1:
        run_local(jobs, devices[0], parts, finished)
    else:
        ctx = get_context("spawn")
        queue = ctx.Manager().Queue()
        for d in devices:
            queue.put(d)
        threads = max(1, (os.cpu_count() or 1) // len(devices))
        with ProcessPoolExecutor(len(devices), mp_context=ctx, initializer=_init_worker,
                                 initargs=(queue, threads)) as pool:
            futures = [pool.submit(_run_in_worker, *job, parts / f"{job[2].key}.safetensors") for job in jobs]
            for fut in as_completed(futures):
                finished(fut.result())
    bar.close()


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
    qc = QuantConfig(bits=round(bits, 2), codebook=opts.codebook, version=__version__,
                     layer_bits={p: K for p, K in opts.bits_for} if len(ks) > 1 else {},
                     original_quantization_config=previous)
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
    work, parts = dst / PARTIAL, dst / PARTIAL / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    stamp, fingerprint = work / "plan.json", plan.fingerprint(opts)
    if stamp.exists() and json.loads(stamp.read_text())["fingerprint"] != fingerprint:
        raise CheckpointError(f"{dst}: holds an unfinished conversion of another source or with other options; "
                              f"remove {work} or choose another DST")
    _atomic_write(stamp, {"fingerprint": fingerprint, "options": asdict(opts)})
    log: list = []
    run_jobs(plan, opts, devices, parts, log, ray_address)
    layout = shard_layout(plan, opts.codebook)
    for shard, items in tqdm(layout.items(), desc="write shards", unit="shard", dynamic_ncols=True):
        if not (dst / shard).exists():
            write_shard(plan, dst, shard, items, parts)
    errors = {p.key: _part_error(parts / f"{p.key}.safetensors") for p in plan.experts}
    report = {"source": str(src), "options": asdict(opts), "devices": devices, "experts": len(plan.experts),
              "seconds": time.perf_counter() - t0, "seconds_this_run_quantizing": sum(e["seconds"] for e in log),
              "tensors": sorted(({"key": k, "K": plan.bits[k], "rel_err": e} for k, e in errors.items()),
                                key=lambda r: -r["rel_err"])}
    finish(plan, dst, opts, layout, report)
    shutil.rmtree(work)
    return report


def _part_error(part: Path) -> float:
    with safe_open(str(part), framework="pt") as f:
        return float(f.metadata()["rel_err"])
