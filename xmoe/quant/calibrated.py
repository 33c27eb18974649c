"""The calibrated conversion: the calibration rows go through the model one decoder layer at a time.

For each layer that has work left: materialise it, run the states through it while capturing the Hessians
of its experts, write them to DST/.xmoe-partial/<pass>/hessians-L, run the layer's jobs against them, and
move the states on to the next layer, through the layer as quantized (`inputs="quantized"`: later layers
are calibrated on the inputs they will see) or as it was (`"original"`). The states entering each layer are
checkpointed (states-L, written atomically), so a killed run resumes at the layer it was in and, every
step being deterministic, ends byte-identical to an uninterrupted one.
"""
import json
import os
import re
import time
from fractions import Fraction
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..format.layer import decode_weight, load_layer
from .alloc import allocate, candidates, group_cost, groups_of, sample
from .capture import LayerStack
from .experts import find_experts
from .jobs import Job, Workers, load_expert


def _save(path: Path, tensors: dict, metadata: dict | None = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _start(root: Path) -> tuple[int, torch.Tensor | None]:
    """The latest checkpointed layer and the states entering it (0, None when nothing is there yet)."""
    done = sorted(int(f.stem.split("-")[1]) for f in root.glob("states-*.safetensors"))
    if not done:
        return 0, None
    with safe_open(str(root / f"states-{done[-1]}.safetensors"), framework="pt") as f:
        return done[-1], f.get_tensor("states")


class Sweep:
    """One pass of the calibration rows over the layers. `jobs_for(layer, hessians)` lists the layer's jobs
    still to run; `quantized(layer)` is None to pass the original layer's output on, else a function of the
    layer's original experts that returns the encoded ones, {expert: {role: (out, in)}}, to run it through."""

    def __init__(self, stack: LayerStack, plan, root: Path, tokens: torch.Tensor, batch: int):
        self.stack, self.plan, self.root, self.tokens, self.batch = stack, plan, root, tokens, batch
        root.mkdir(parents=True, exist_ok=True)
        self.shard_of = {t.name: s for s, ts in plan.shards.items() for t in ts}

    def experts(self, i: int) -> dict | None:
        """Original (out, in) weights of layer i's routed experts, kept ones included."""
        by_expert = self.stack.experts.get(i)
        if not by_expert:
            return None
        return {e: {r: load_expert(self.plan.src, self.shard_of[p.source], p, self.stack.device)
                    for r, p in roles.items()} for e, roles in by_expert.items()}

    def run(self, last: int, jobs_for, quantized, workers: Workers, finished, desc: str, weigh: bool = False
            ) -> dict[int, float]:
        """Layers up to `last`; returns {layer: energy of its routed experts' output / energy of its input} of
        the layers it captured (every MoE layer with `weigh`, else those with jobs)."""
        start, states = _start(self.root)
        if states is None:
            states = self.stack.embed(self.tokens).to("cpu")
        energy_file = self.root / "energy.json"
        energy = {int(k): v for k, v in json.loads(energy_file.read_text()).items()} if energy_file.exists() else {}
        for i in tqdm(range(start, last + 1), desc=desc, unit="layer", initial=start, total=last + 1,
                      dynamic_ncols=True):
            hessians = self.root / f"hessians-{i}.safetensors"
            jobs = jobs_for(i, hessians)
            capture = i in self.stack.paths and (bool(jobs) or (weigh and i not in energy))
            layer = self.stack.layer(i, self.experts(i), capture)
            out = self.stack.forward(layer, states, self.batch)
            if capture:
                mod = layer.get_submodule(self.stack.paths[i])
                residual = sum(float(s.double().pow(2).sum()) for s in states.split(self.batch))
                energy[i] = mod.energy / max(residual, 1e-30)
                _save(hessians, mod.hessians(), {"count": str(mod.count), "dropped": str(mod.dropped)})
                del mod.h_input, mod.h_down
                workers.run(jobs, finished)
                hessians.unlink()
                _atomic_json(energy_file, energy)
            q = quantized(i) if i in self.stack.paths else None
            if q is not None:
                self.stack.release(i)
                layer = self.stack.layer(i, q(self.experts(i)), capture=False)
                out = self.stack.forward(layer, states, self.batch)
            self.stack.release(i)
            states = out
            if i < last:
                _save(self.root / f"states-{i + 1}.safetensors", {"states": states})
            (self.root / f"states-{i}.safetensors").unlink(missing_ok=True)
        return energy


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def decoded_experts(stack: LayerStack, parts: Path, i: int, original: dict) -> dict:
    """Layer i's experts as encoded (from their part files), kept experts as they were."""
    out = {}
    for e, roles in stack.experts[i].items():
        out[e] = {}
        for r, p in roles.items():
            part = parts / f"{p.key}.safetensors"
            if part.exists():
                w = decode_weight(load_layer(part, p.key))
                n_out, n_in = original[e][r].shape
                out[e][r] = w[:n_in, :n_out].T.to(stack.device)
            else:
                out[e][r] = original[e][r]
    return out


def capture_batch(cols: int) -> int:
    """Rows per forward: about 16k tokens."""
    return max(1, 16384 // cols)


def capture_device(devices: list[str]) -> tuple[str, torch.dtype]:
    """Capture runs on the first GPU in bf16, else on the CPU in fp32 (bf16 matmuls are slow there)."""
    dev = next((d for d in devices if d.startswith("cuda")), "cpu")
    return dev, (torch.bfloat16 if dev != "cpu" else torch.float32)


def _stack(plan, opts, devices) -> LayerStack:
    config, shapes = plan.config, {t.name: t.shape for ts in plan.shards.values() for t in ts}
    everything = find_experts(config, shapes, opts.experts_regex)  # kept experts run in the layers too
    return LayerStack(plan.src, plan.shards, everything, *capture_device(devices))


def quantize_calibrated(plan, opts, workers: Workers, work: Path, calib, devices: list[str], bar, finished
                        ) -> dict:
    """Encode every expert against the Hessians of its layer, captured one layer at a time."""
    t0 = time.perf_counter()
    stack = _stack(plan, opts, devices)
    sweep = Sweep(stack, plan, work / "capture", calib.tokens, capture_batch(opts.calib_cols))
    parts = work / "parts"
    by_layer: dict[int, list] = {}
    for p in plan.experts:
        by_layer.setdefault(p.layer, []).append(p)
    bar.update(sum((parts / f"{p.key}.safetensors").exists() for p in plan.experts))

    def jobs_for(i: int, hessians: Path) -> list[Job]:
        return [Job(plan.src, sweep.shard_of[p.source], p, opts, parts / f"{p.key}.safetensors", K=plan.bits[p.key],
                    hessians=hessians) for p in by_layer.get(i, []) if not (parts / f"{p.key}.safetensors").exists()]

    def quantized(i: int):
        if opts.calib_inputs == "original" or i not in by_layer:
            return None
        return lambda original: decoded_experts(stack, parts, i, original)

    if by_layer:
        sweep.run(max(by_layer), jobs_for, quantized, workers, finished, "calibrate")
    return {"source": calib.source, "rows": int(calib.tokens.shape[0]), "cols": int(calib.tokens.shape[1]),
            "tokens_sha256": calib.digest, "inputs": opts.calib_inputs,
            "seconds_this_run": round(time.perf_counter() - t0, 1)}


def allocate_bits(plan, opts, workers: Workers, work: Path, calib, devices: list[str]) -> dict:
    """Measure error curves on a sample of each group's experts (against the captured Hessians when
    calibrating), pick K per group within the budget and set plan.bits; the choice is kept in
    DST/.xmoe-partial/allocation.json, so a resumed run does not measure again."""
    done = work / "allocation.json"
    if done.exists():
        report = json.loads(done.read_text())
    else:
        report = _measure_and_allocate(plan, opts, workers, work, calib, devices)
        _atomic_json(done, report)
    chosen = {g["group"]: g["K"] for g in report["groups"]}
    for p in plan.experts:
        if plan.bits[p.key] is None:
            plan.bits[p.key] = next(K for pattern, K in chosen.items() if re.search(pattern, p.key))
    return report


def _measure_and_allocate(plan, opts, workers, work, calib, devices) -> dict:
    t0 = time.perf_counter()
    groups = groups_of([p for p in plan.experts if plan.bits[p.key] is None], plan.shapes)
    Ks = tuple(candidates(opts.bits, opts.codebook))
    out = work / "curves"
    out.mkdir(exist_ok=True)
    shard_of = {t.name: s for s, ts in plan.shards.items() for t in ts}
    sampled = [p for g in groups for p in sample(g, opts.sample_experts)]

    def jobs_for(i: int | None, hessians: Path | None) -> list[Job]:
        return [Job(plan.src, shard_of[p.source], p, opts, out / f"{p.key}.json", Ks=Ks, hessians=hessians)
                for p in sampled if (i is None or p.layer == i) and not (out / f"{p.key}.json").exists()]

    bar = tqdm(total=len(sampled), desc="measure", unit="tensor", dynamic_ncols=True)
    bar.update(len(sampled) - len(jobs_for(None, None)))
    weight: dict[int, float] = {}
    if calib is not None and groups:
        stack = _stack(plan, opts, devices)
        sweep = Sweep(stack, plan, work / "measure", calib.tokens, capture_batch(opts.calib_cols))
        weight = sweep.run(max(g.layer for g in groups), jobs_for, lambda i: None, workers, lambda e: bar.update(),
                           "measure", weigh=True)
    else:
        workers.run(jobs_for(None, None), lambda e: bar.update())
    bar.close()
    curves = {}
    for p in sampled:
        entry = json.loads((out / f"{p.key}.json").read_text())
        curves[p.key] = {float(K): e for K, e in entry["curve"].items()}
    costs = [group_cost(g, curves, weight.get(g.layer, 1.0)) for g in groups]
    fixed = [(plan.bits[p.key], plan.shapes[p.key]) for p in plan.experts if plan.bits[p.key] is not None]
    fixed_numel = sum(o * i for _, (o, i) in fixed)
    fixed_bits = sum(Fraction(str(K)) * o * i for K, (o, i) in fixed)
    picks = allocate(costs, [g.numel for g in groups], opts.bits, fixed_bits, fixed_numel)
    total = sum(g.numel for g in groups) + fixed_numel
    achieved = (sum(Fraction(str(K)) * g.numel for g, K in zip(groups, picks)) + fixed_bits) / max(total, 1)
    return {"bits": opts.bits, "achieved_bits": float(achieved), "candidates": list(Ks),
            "calibrated": calib is not None, "seconds": round(time.perf_counter() - t0, 1),
            "groups": [{"group": g.name, "layer": g.layer, "roles": list(g.roles), "K": K, "numel": g.numel,
                        "weight": weight.get(g.layer, 1.0), "cost": {repr(k): v for k, v in c.items()}}
                       for g, K, c in zip(groups, picks, costs)]}
