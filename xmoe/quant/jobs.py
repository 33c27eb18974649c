"""Per-expert work of `xmoe quantize` and where it runs: one job encodes (or measures) one expert projection
into its own small file, so a killed run keeps every finished one. Jobs run in this process (one device),
in a pool of processes (one per device), or as Ray tasks."""
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch
from safetensors import safe_open

from ..format.layer import decode_weight, save_layers
from .experts import ExpertProj
from .hessian import hessian_problem
from .ldlq import error_curve, quantize_ldlq
from .linear import quantize_linear
from .plan import ConvertOptions
from .source import dequantize


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


def hessian_key(p: ExpertProj) -> str:
    """Which Hessian of its layer's file an expert projection is encoded against (capture.py writes them)."""
    return f"down.{p.expert}" if p.role == "down" else "input"


def load_hessian(path: Path, p: ExpertProj, device: str) -> tuple[torch.Tensor, str | None]:
    """(H, why it cannot be used or None) of one projection from its layer's Hessian file."""
    with safe_open(str(path), framework="pt") as f:
        H = f.get_tensor(hessian_key(p)).to(device)
        count = int(f.metadata()["count"])
    return H, hessian_problem(H, count)


@dataclass(frozen=True)
class Job:
    """Encode projection `p` at K into `out` (a safetensors part), or with `Ks` measure its error curve into
    `out` (JSON). `hessians`: its layer's Hessian file (None: uncalibrated)."""
    src: Path
    shard: str
    p: ExpertProj
    opts: ConvertOptions
    out: Path
    K: float = 0
    Ks: tuple[float, ...] = ()
    hessians: Path | None = None

    def run(self, device: str, stored: tuple | None = None) -> dict:
        t0 = time.perf_counter()
        stored = stored or read_expert(self.src, self.shard, self.p)
        w = load_expert(self.src, self.shard, self.p, device, stored)
        H, problem = load_hessian(self.hessians, self.p, device) if self.hessians else (None, None)
        entry = self._measure(w, H) if self.Ks else self._quantize(w, H, problem)
        nbytes = sum(x.numel() * x.element_size() for x in stored if x is not None)
        return {**entry, "seconds": time.perf_counter() - t0, "bytes_in": nbytes}

    def _quantize(self, w: torch.Tensor, H: torch.Tensor | None, problem: str | None) -> dict:
        o, seed = self.opts, expert_seed(self.p.key, self.opts.seed)
        meta = {}
        if H is not None and problem is None:
            t, info = quantize_ldlq(w, H, self.K, o.codebook, o.encoder, seed, name=self.p.key,
                                    beam_width=o.beam_width)
            meta = {"proxy_err": info["proxy_err"], "cholesky_retries": info["cholesky_retries"]}
        else:
            t = quantize_linear(w, self.K, o.codebook, o.encoder, seed=seed, beam_width=o.beam_width)
            if problem:
                meta = {"fallback": problem}
        w_hat = decode_weight({k: v.to(w.device) for k, v in t.items()})[: w.shape[1], : w.shape[0]].T
        meta["rel_err"] = float((w_hat - w).pow(2).sum() / w.pow(2).sum().clamp_min(1e-30))
        save_layers(self.out, {self.p.key: t}, metadata={k: repr(v) if not isinstance(v, str) else v
                                                         for k, v in meta.items()})
        return {"key": self.p.key, "K": self.K, **meta}

    def _measure(self, w: torch.Tensor, H: torch.Tensor | None) -> dict:
        o = self.opts
        if H is not None and hessian_problem(H, 1):
            H = None
        curve = error_curve(w, H, list(self.Ks), o.codebook, o.encoder, expert_seed(self.p.key, o.seed),
                            name=self.p.key, strips=o.sample_strips, beam_width=o.beam_width)
        entry = {"key": self.p.key, "curve": {repr(K): e for K, e in curve.items()}}
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(entry) + "\n")
        os.replace(tmp, self.out)
        return entry


def part_metadata(part: Path) -> dict:
    """What a finished part file says about its tensor: rel_err, and proxy_err or fallback where calibrated."""
    with safe_open(str(part), framework="pt") as f:
        meta = f.metadata()
    return {k: (v if k == "fallback" else (int(v) if k == "cholesky_retries" else float(v))) for k, v in meta.items()}


_device = None


def _init_worker(devices, threads):
    global _device
    _device = devices.get()
    if _device.startswith("cuda"):
        torch.cuda.set_device(_device)
    torch.set_num_threads(threads)  # CPU workers share the cores instead of oversubscribing them


def _run_in_worker(job: Job) -> dict:
    return job.run(_device)


def _ray_job(job: Job) -> dict:
    """A Ray task: one job on the GPU Ray assigned to it, else on the CPU."""
    return job.run("cuda" if torch.cuda.is_available() else "cpu")


class Workers:
    """Runs jobs on `devices`: in this process for one device (the next job's source read by a thread while
    one is encoded), in a pool of processes kept for the whole conversion for several, or on a Ray cluster
    (every node must see SRC and DST at the same paths; "local" starts one)."""

    def __init__(self, devices: list[str], ray_address: str | None = None):
        self.devices, self.ray_address, self.pool = devices, ray_address, None

    def __enter__(self):
        if self.ray_address:
            import ray
            local = self.ray_address == "local"
            ray.init(address=None if local else self.ray_address, ignore_reinit_error=True,
                     runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}} if local else None)
            gpus = any(d.startswith("cuda") for d in self.devices)
            self.task = ray.remote(num_gpus=1 if gpus else 0, num_cpus=1)(_ray_job)
        elif len(self.devices) > 1:
            ctx = get_context("spawn")
            queue = ctx.Manager().Queue()
            for d in self.devices:
                queue.put(d)
            threads = max(1, (os.cpu_count() or 1) // len(self.devices))
            self.pool = ProcessPoolExecutor(len(self.devices), mp_context=ctx, initializer=_init_worker,
                                            initargs=(queue, threads))
        return self

    def __exit__(self, *exc):
        if self.pool:
            self.pool.shutdown(cancel_futures=True)

    def run(self, jobs: list[Job], finished) -> None:
        """Run every job, calling finished(entry) as each completes."""
        if not jobs:
            return
        if self.ray_address:
            import ray
            pending = [self.task.remote(job) for job in jobs]
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                finished(ray.get(ready[0]))
        elif self.pool:
            for fut in as_completed([self.pool.submit(_run_in_worker, job) for job in jobs]):
                finished(fut.result())
        else:
            with ThreadPoolExecutor(1) as reader:
                ahead = reader.submit(read_expert, jobs[0].src, jobs[0].shard, jobs[0].p)
                for i, job in enumerate(jobs):
                    stored = ahead.result()
                    if i + 1 < len(jobs):
                        ahead = reader.submit(read_expert, jobs[i + 1].src, jobs[i + 1].shard, jobs[i + 1].p)
                    finished(job.run(self.devices[0], stored))
