"""Bad input gets a clear error naming the file and tensor, and nothing half-written looks finished."""
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import save_hf
from xmoe.quant import st_io
from xmoe.quant.convert import PARTIAL, convert
from xmoe.quant.plan import INDEX, ConvertOptions

pytest.importorskip("transformers")
BEAM = ConvertOptions(encoder="beam", beam_width=16)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def src(tmp_path):
    return save_hf("olmoe", tmp_path / "src")


def shard_holding(src: Path, tensor: str) -> Path:
    return src / json.loads((src / INDEX).read_text())["weight_map"][tensor]


def test_truncated_shard(src, tmp_path):
    shard = shard_holding(src, "model.layers.1.mlp.experts.3.down_proj.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(st_io.CheckpointError, match=rf"{shard.name}: truncated: tensor \S+ ends at byte"):
        convert(src, tmp_path / "dst", BEAM, ["cpu"])
    assert not (tmp_path / "dst" / "config.json").exists()


def test_corrupt_header(src, tmp_path):
    shard = shard_holding(src, "model.norm.weight")
    data = bytearray(shard.read_bytes())
    data[10:20] = b"\xff" * 10
    shard.write_bytes(bytes(data))
    with pytest.raises(st_io.CheckpointError, match=f"{shard.name}: corrupt safetensors header"):
        convert(src, tmp_path / "dst", BEAM, ["cpu"])


def test_index_names_missing_tensor_or_shard(src, tmp_path):
    index = json.loads((src / INDEX).read_text())
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = index["weight_map"]["model.norm.weight"]
    (src / INDEX).write_text(json.dumps(index))
    with pytest.raises(st_io.CheckpointError, match="tensor model.layers.0.mlp.ghost.weight is not in"):
        convert(src, tmp_path / "dst", BEAM, ["cpu"])
    index["weight_map"]["model.layers.0.mlp.ghost.weight"] = "model-09999-of-09999.safetensors"
    (src / INDEX).write_text(json.dumps(index))
    with pytest.raises(st_io.CheckpointError, match="names shard model-09999-of-09999.safetensors"):
        convert(src, tmp_path / "dst", BEAM, ["cpu"])


def rewrite(src: Path, tensor: str, value: torch.Tensor) -> None:
    shard = shard_holding(src, tensor)
    tensors = load_file(str(shard))
    tensors[tensor] = value
    save_file(tensors, str(shard), metadata={"format": "pt"})


def test_unsupported_dtype_names_tensor(src, tmp_path):
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    rewrite(src, name, torch.zeros(32, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match=rf"{name}: unsupported expert weight dtype torch.int32"):
        convert(src, tmp_path / "dst", BEAM, ["cpu"])


def test_shape_mismatch(src, tmp_path):
    rewrite(src, "model.layers.1.mlp.experts.2.gate_proj.weight", torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(st_io.CheckpointError, match="layer 1: gate experts have differing shapes"):
        convert(src, tmp_path / "dst", BEAM, ["cpu"])


def test_expert_count_checked_against_config(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "num_experts": 8}))
    with pytest.raises(ValueError, match="layer 0: found 4 routed experts, config.json says 8"):
        convert(src, tmp_path / "dst", BEAM, ["cpu"])


def test_full_disk_leaves_nothing_finished(src, tmp_path, monkeypatch):
    real = st_io.ShardWriter.write

    def failing(self, name, chunks):
        if "lm_head" in name:
            raise st_io.CheckpointError(f"{self.tmp}: writing tensor {name}: No space left on device")
        return real(self, name, chunks)

    monkeypatch.setattr(st_io.ShardWriter, "write", failing)
    dst = tmp_path / "dst"
    with pytest.raises(st_io.CheckpointError, match="No space left on device"):
        convert(src, dst, BEAM, ["cpu"])
    assert not (dst / "config.json").exists() and not list(dst.glob("*.tmp"))
    assert (dst / PARTIAL / "parts").is_dir()  # the experts already done are kept for the rerun
    monkeypatch.setattr(st_io.ShardWriter, "write", real)
    convert(src, dst, BEAM, ["cpu"])
    assert (dst / "config.json").exists()


class FullDisk:
    def __init__(self, f):
        self.f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self):
        self.f.close()


def test_writer_reports_os_errors(tmp_path):
    w = st_io.ShardWriter(tmp_path / "x.safetensors", [("a", "F32", (4,))])
    with pytest.raises(st_io.CheckpointError, match="x.safetensors.tmp: writing tensor a: No space left on device"):
        with w:
            w.file = FullDisk(w.file)
            w.write("a", [b"\0" * 16])
    assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "x.safetensors.tmp").exists()


def test_resume_refuses_other_options_and_finished_dst(src, tmp_path):
    dst = tmp_path / "dst"
    (dst / PARTIAL).mkdir(parents=True)
    (dst / PARTIAL / "plan.json").write_text(json.dumps({"fingerprint": "something else"}))
    with pytest.raises(st_io.CheckpointError, match="unfinished conversion of another source or with other"):
        convert(src, dst, BEAM, ["cpu"])
    (dst / "config.json").write_text("{}")
    with pytest.raises(st_io.CheckpointError, match="already holds a finished model"):
        convert(src, dst, BEAM, ["cpu"])


def test_cli_reports_bad_input_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "xmoe", "quantize", str(tmp_path / "nowhere"), str(tmp_path / "d")],
                         capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 2
    assert run.stderr.strip() == f"xmoe quantize: error: {tmp_path / 'nowhere'}: no such directory"


@pytest.mark.parametrize("make,why", [
    (lambda p: None, "no such directory"),
    (lambda p: p.write_text("x"), "not a directory (expected a Hugging Face model directory)"),
    (lambda p: p.mkdir(), "no config.json (is this a Hugging Face model directory?)"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text("{")), None),
])
def test_inspect_names_what_is_wrong_with_the_directory(tmp_path, capsys, make, why):
    from xmoe.cli import main
    path = tmp_path / "model"
    make(path)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    want = f"{path}: {why}" if why else f"{path / 'config.json'}: not valid JSON ("
    assert err.startswith(f"xmoe inspect: error: {want}") and "\n" not in err, err
