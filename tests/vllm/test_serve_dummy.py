"""`--load-format dummy` on an EXL3 pack: a directory with only config.json and a tokenizer serves random EXL3
experts at the config's K and codebook (the speed benchmarks' path, benchmarks/serve_gpu.py, which needs no
weights on disk). On the CPU, through the kernels under the Triton interpreter, as on a GPU."""
import json

import pytest
import torch
from serving import Server

from checkpoints import SERVE_BASE, hf_config, save_word_tokenizer  # noqa: I001 (on sys.path via serving)
from xmoe.format import QuantConfig, decode_weight
from xmoe.vllm.dummy import DummyExl3


def test_dummy_experts_have_the_packs_shapes_and_a_sane_scale():
    experts = DummyExl3(K=2, codebook="mcg").experts(3, 256, 128, "cpu")
    assert experts.count == 3 and (experts.hidden, experts.intermediate) == (256, 128)
    assert tuple(experts.gate.trellis.shape) == (3, 16, 8, 32) and tuple(experts.down.trellis.shape) == (3, 8, 16, 32)
    w = decode_weight(experts.gate.tensors(1))  # (in, out): y = x W keeps the scale of x
    assert torch.isfinite(w).all() and 0.5 < float(w.std() * 256 ** 0.5) < 2


def test_config_only_pack_serves_random_experts(tmp_path):
    pytest.importorskip("triton")
    model = tmp_path / "pack"
    model.mkdir()
    config = hf_config("qwen3_moe", SERVE_BASE).to_dict()
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    config["quantization_config"] = QuantConfig(bits=2, codebook="mcg", version="test").to_dict()
    (model / "config.json").write_text(json.dumps(config))
    save_word_tokenizer(model, SERVE_BASE["vocab_size"])
    with Server(model, "--load-format", "dummy", env={"TRITON_INTERPRET": "1"}) as server:
        out = server.greedy(model, [[3, 4, 5]], 4)
        log = server.log_text()
    assert len(out[0]) == 4
    assert "random EXL3 experts at K=2 mcg" in log
