import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from checkpoints import fp8_with_scale, save_deepseek_native, save_fused_qwen3, save_hf
from xmoe.format import decode_weight
from xmoe.quant.convert import PARTIAL, REPORT, convert, load_expert
from xmoe.quant.plan import INDEX, ConvertOptions, make_plan, read_source
from xmoe.quant.source import dequantize
from xmoe.quant.st_io import copy_chunks, read_header

pytest.importorskip("transformers")
BEAM = ConvertOptions(bits=2, codebook="mcg", encoder="beam", beam_width=16)
REPO = Path(__file__).resolve().parents[2]


def raw_tensors(path: Path) -> dict[str, bytes]:
    """name -> raw bytes over every shard of a model directory."""
    _, shards = read_source(path)
    return {t.name: b"".join(copy_chunks(path / s, t)) for s, ts in shards.items() for t in ts}


def check_converted(src: Path, dst: Path, opts: ConvertOptions = BEAM, bound: float = 0.13):
    plan = make_plan(src, opts)
    before, after = raw_tensors(src), raw_tensors(dst)
    replaced = {p.source for p in plan.experts} | {p.scale for p in plan.experts if p.scale}
    for name, data in before.items():  # everything else byte-identical
        assert (name in after and after[name] == data) != (name in replaced), name
    shard_of = {t.name: s for s, ts in plan.shards.items() for t in ts}
    index = json.loads((dst / INDEX).read_text())["weight_map"]
    for p in plan.experts:
        with safe_open(str(dst / index[f"{p.key}.trellis"]), framework="pt") as f:
            t = {k.rsplit(".", 1)[1]: f.get_tensor(k) for k in f.keys() if k.startswith(p.key + ".")}
        w = load_expert(src, shard_of[p.source], p)
        w_hat = decode_weight(t)[: w.shape[1], : w.shape[0]].T
        assert float((w_hat - w).pow(2).sum() / w.pow(2).sum()) < bound, p.key
    for name, shard in index.items():  # the index names exactly what each shard holds
        assert name in {t.name for t in read_header(dst / shard)[0]}
    assert set(index) == set(after)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "exl3" and not (dst / PARTIAL).exists()
    return plan, config


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_hf_architectures(tmp_path, arch):
    src = save_hf(arch, tmp_path / "src")
    assert len(list(src.glob("*.safetensors"))) > 1
    report = convert(src, tmp_path / "dst", BEAM, ["cpu"])
    plan, _ = check_converted(src, tmp_path / "dst")
    n_moe_layers = 1 if arch == "deepseek_v3" else 2  # first_k_dense_replace=1
    assert len(plan.experts) == report["experts"] == n_moe_layers * 4 * 3
    assert all("shared_experts" not in p.key for p in plan.experts)
    assert (tmp_path / "dst" / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    errs = [t["rel_err"] for t in report["tensors"]]
    assert errs == sorted(errs, reverse=True) and 0 < errs[-1] <= errs[0] < 0.13


def test_deepseek_native_mxfp4_fp8_engram_mtp(tmp_path):
    src = save_deepseek_native(tmp_path / "src")
    convert(src, tmp_path / "dst", BEAM, ["cpu"])
    plan, config = check_converted(src, tmp_path / "dst")
    keys = {p.key for p in plan.experts}
    assert len(keys) == 2 * 4 * 3 and all(k.startswith(("layers.0.", "layers.1.")) for k in keys)
    assert config["quantization_config"]["original_quantization_config"]["quant_method"] == "fp8"
    after = raw_tensors(tmp_path / "dst")
    for kept in ("layers.1.engram.table", "mtp.0.ffn.experts.0.w1.weight", "layers.2.ffn.experts.0.w1.weight",
                 "layers.2.ffn.experts.0.w1.scale", "layers.0.attn.wq.scale", "layers.0.ffn.gate.bias"):
        assert kept in after
    assert "layers.0.ffn.experts.0.w1.scale" not in after


@pytest.mark.gpu
def test_gpu_dequantize_matches_cpu(tmp_path):
    """Workers dequantize sources on their GPU: the same fp32 weights as on the CPU (which the CPU tests check
    against the source), for MXFP4 experts and FP8 blocks with fp32 and e8m0 scales."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    src = save_deepseek_native(tmp_path / "src")
    plan = make_plan(src, BEAM)
    shard_of = {t.name: s for s, ts in plan.shards.items() for t in ts}
    for p in plan.experts:
        cpu, gpu = (load_expert(src, shard_of[p.source], p, device) for device in ("cpu", "cuda"))
        assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu), p.key
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    for e8m0 in (False, True):
        t = fp8_with_scale(w, 32, e8m0)
        cpu = dequantize(t["weight"], t["scale"], "w")
        assert torch.equal(dequantize(t["weight"].cuda(), t["scale"].cuda(), "w").cpu(), cpu)


def test_fused_experts_split_per_expert(tmp_path):
    src = save_fused_qwen3(tmp_path / "src")
    convert(src, tmp_path / "dst", BEAM, ["cpu"])
    plan, _ = check_converted(src, tmp_path / "dst")
    index = json.loads((tmp_path / "dst" / INDEX).read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.3.up_proj.trellis" in index
    assert "model.layers.0.mlp.experts.gate_up_proj" not in index
    with safe_open(str(src / "model-00001-of-00001.safetensors"), framework="pt") as f:
        fused = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj").float()
    up = next(p for p in plan.experts if p.key == "model.layers.1.mlp.experts.2.up_proj")
    assert torch.equal(load_expert(src, "model-00001-of-00001.safetensors", up), fused[2, 32:])


def test_rules_bits_for_and_keep(tmp_path):
    src = save_hf("olmoe", tmp_path / "src")
    opts = ConvertOptions(bits=2, encoder="beam", beam_width=16, bits_for=((r"layers\.1\..*down", 3),),
                          keep=(r"experts\.0\.",))
    convert(src, tmp_path / "dst", opts, ["cpu"])
    index = json.loads((tmp_path / "dst" / INDEX).read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in index
    assert "model.layers.0.mlp.experts.0.gate_proj.trellis" not in index
    with safe_open(str(tmp_path / "dst" / index["model.layers.1.mlp.experts.2.down_proj.trellis"]), "pt") as f:
        assert f.get_slice("model.layers.1.mlp.experts.2.down_proj.trellis").get_shape()[-1] == 48
    with safe_open(str(tmp_path / "dst" / index["model.layers.1.mlp.experts.2.up_proj.trellis"]), "pt") as f:
        assert f.get_slice("model.layers.1.mlp.experts.2.up_proj.trellis").get_shape()[-1] == 32


def test_unknown_architecture_and_experts_regex(tmp_path):
    src = save_hf("olmoe", tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "my_moe"}))
    with pytest.raises(ValueError, match="--experts-regex"):
        make_plan(src, BEAM)
    regex = r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>\w+_proj)\.weight$"
    opts = ConvertOptions(encoder="beam", beam_width=16, experts_regex=regex)
    assert len(make_plan(src, opts).experts) == 2 * 4 * 3


def cli(src, dst, *extra):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return [sys.executable, "-m", "xmoe", "quantize", str(src), str(dst), "--encoder", "beam",
            "--beam-width", "16", "--devices", "cpu", *extra], env


def model_files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.is_file() and f.name != REPORT}


def test_resume_after_kill_is_byte_identical(tmp_path):
    src = save_hf("qwen3_moe", tmp_path / "src")
    cmd, env = cli(src, tmp_path / "whole")
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    cmd, env = cli(src, tmp_path / "resumed")
    parts = tmp_path / "resumed" / PARTIAL / "parts"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(parts.glob("*.safetensors"))) < 5:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(parts.glob("*.safetensors")))
    assert 5 <= done < 24 and not (tmp_path / "resumed" / "config.json").exists()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert model_files(tmp_path / "resumed") == model_files(tmp_path / "whole")


def test_two_workers_match_one(tmp_path):
    src = save_hf("mixtral", tmp_path / "src")
    convert(src, tmp_path / "one", BEAM, ["cpu"])
    convert(src, tmp_path / "two", BEAM, ["cpu", "cpu"])
    assert model_files(tmp_path / "one") == model_files(tmp_path / "two")


def test_bounded_memory(tmp_path):
    """A 768 MiB pass-through tensor is streamed: peak RSS stays far below its size."""
    src = save_hf("olmoe", tmp_path / "src")
    big = torch.zeros(192 << 20, dtype=torch.float32).reshape(-1, 1024)
    from safetensors.torch import save_file
    save_file({"model.big_table.weight": big}, str(src / "big.safetensors"))
    del big
    index = json.loads((src / INDEX).read_text())
    index["weight_map"]["model.big_table.weight"] = "big.safetensors"
    (src / INDEX).write_text(json.dumps(index))
    cmd, env = cli(src, tmp_path / "dst")
    probe = "import resource, runpy, sys; sys.argv = ['xmoe'] + sys.argv[1:]; " \
            "exec('try:\\n runpy.run_module(\"xmoe\", run_name=\"__main__\")\\nexcept SystemExit: pass'); " \
            "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    run = subprocess.run([sys.executable, "-c", probe, *cmd[3:]], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    peak_mib = int(run.stdout.split("PEAK")[-1]) / 1024
    base = subprocess.run([sys.executable, "-c", "import resource, torch, xmoe.quant.convert, transformers; "
                           "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"],
                          env=env, capture_output=True, text=True)
    base_mib = int(base.stdout) / 1024
    assert (tmp_path / "dst" / "big.safetensors").stat().st_size > 768 << 20
    assert peak_mib - base_mib < 200, (peak_mib, base_mib)


def test_local_ray_cluster_matches_single_process(tmp_path):
    pytest.importorskip("ray")
    import ray
    src = save_hf("olmoe", tmp_path / "src")
    convert(src, tmp_path / "one", BEAM, ["cpu"])
    try:
        convert(src, tmp_path / "ray", BEAM, ["cpu"], ray_address="local")
    finally:
        ray.shutdown()
    assert model_files(tmp_path / "one") == model_files(tmp_path / "ray")


def test_inspect(tmp_path, capsys):
    from xmoe.cli import main
    src = save_deepseek_native(tmp_path / "src")
    convert(src, tmp_path / "dst", BEAM, ["cpu"])
    assert main(["inspect", str(tmp_path / "dst")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("layers.*.ffn.experts.*.w1 "))
    # layers 0-1 quantized (4 tensors each: suh, svh, trellis, mcg); layer 2 is an MTP layer kept in MXFP4
    assert row.split()[1:4] == ["U8/exl3", "2", str(2 * 4 * 4 + 4 * 2)]
    assert "layers.*.engram " in out and "F8_E4M3" in out and '"quant_method": "exl3"' in out
