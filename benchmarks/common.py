"""Timing helpers shared by the kernel benchmarks: CUDA-graph replay timing, eager timing (one call at a time or
back to back), copy bandwidth, launch settings (Tuning) from the command line, and what a --json file says of its
run."""
import ast
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def copy_bandwidth(dev, gib: float = 2.0, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second: the memory roofline of this run."""
    n = int(gib * 2 ** 30) // 4
    a, b = torch.empty(n, dtype=torch.float32, device=dev), torch.empty(n, dtype=torch.float32, device=dev)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 4 * reps / (start.elapsed_time(end) / 1e3)


def time_graph(fn, reps: int = 50, warmup: int = 3) -> float:
    """Median seconds per call of fn replayed from a CUDA graph (fn warmed up eagerly first)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return _median_events(graph.replay, reps)


def time_eager(fn, reps: int = 50, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    return _median_events(fn, reps)


def time_pipelined(fn, reps: int = 20, batches: int = 5, warmup: int = 3) -> float:
    """Median seconds per call of fn when `reps` calls run back to back, as a model's layers do: the host queues
    the next call while the GPU runs this one. Each call follows an L2 flush; the flushes' own time is taken out."""
    for _ in range(warmup):
        fn()
    flush = _flush_buffer()

    def batch(f) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            flush.zero_()
            f()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    times = sorted(batch(fn) - batch(lambda: None) for _ in range(batches))
    return times[len(times) // 2]


def _flush_buffer() -> torch.Tensor:
    return torch.empty(64 * 2 ** 20, dtype=torch.int8, device="cuda")  # larger than L2: zeroing it evicts weights


def _median_events(fn, reps: int) -> float:
    flush = _flush_buffer()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def ptrs(tensors, dev) -> torch.Tensor:
    """int64 device table of data pointers, as exllamav3's multi-matrix kernels take them."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.long, device=dev)


def row(cells, widths) -> str:
    return " ".join(f"{c:>{w}}" for c, w in zip(cells, widths))


def tuning_of(pairs: list, base=None):
    """A Tuning from ["FIELD=VALUE", ...] over `base` (the device's, else the default): values are Python literals,
    a tile's field is written TILE.FIELD (gemv.BK=32), and fill=N sets every grouped tile's fill. None for no pairs;
    an unknown field stops the run at once."""
    from dataclasses import replace

    from xmoe.kernels.tuning import DEFAULT, Tile, Tuning
    if not pairs:
        return None
    tuning = base or DEFAULT
    for pair in pairs:
        name, _, text = pair.partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # decoder=gather
        tile, _, field = name.partition(".")
        try:
            if name == "fill":
                tuning = tuning.with_fill(int(value))
            elif field:
                if not isinstance(getattr(tuning, tile, None), Tile):
                    raise ValueError(f"{tile!r} is not a tile")
                tuning = replace(tuning, **{tile: replace(getattr(tuning, tile), **{field: value})})
            else:
                tuning = replace(tuning, **{name: getattr(Tuning.from_dict({name: value}), name)})
        except (TypeError, ValueError) as e:
            raise SystemExit(f"{pair}: {e}") from None
    return tuning


def run_info() -> dict:
    """What a --json file says of its run: commit, date (UTC), GPU ("CPU" without one), torch and Triton."""
    import datetime
    import subprocess

    import triton
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return dict(commit=commit + ("+changes" if dirty else ""), date=datetime.date.today().isoformat(),
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU", torch=torch.__version__,
                triton=triton.__version__)
