"""benchmarks/serve_gpu.py reads a torch-profiler trace of decode steps: kernel time by kind per step, and the
GPU's wall span per step, whose excess over the kernels is the time the GPU waited on the host."""
import gzip
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("serve_gpu", ROOT / "benchmarks" / "serve_gpu.py")
serve_gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_gpu)


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_two_steps_of_two_layers_with_a_host_gap(tmp_path):
    events, t = [], 0.0
    for _ in range(2):  # per step: 2 layers of attention + experts, then the LM head; 100 us idle after it
        for _ in range(2):
            events += [kernel("flash_fwd_kernel", t, 10), kernel("grouped_mma_kernel", t + 10, 30)]
            t += 40
        events.append(kernel("sm90_xmma_gemm_bf16", t, 20))
        t += 20 + 100
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000})  # host events are not kernels
    with gzip.open(tmp_path / "rank0.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = serve_gpu.step_profile(tmp_path, layers=2)
    assert got["steps"] == 2
    assert (got["attention_us"], got["experts_us"], got["other_us"], got["routing_us"]) == (20, 60, 20, 0)
    assert got["step_us"] == 100
    assert got["span_us"] == pytest.approx((2 * 200 - 100) / 2)  # the last step's trailing gap is outside the span
    assert got["experts_share"] == pytest.approx(0.6)


def test_a_trace_without_attention_says_so(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": [kernel("grouped_mma", 0, 5)]}))
    assert "not countable" in serve_gpu.step_profile(tmp_path, layers=1)["error"]
