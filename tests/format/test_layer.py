import pytest
import torch

from xmoe.format import (FormatError, QuantConfig, check_layer, decode_inner, decode_weight, had_cols, had_rows,
                         hadamard_128, load_layer, marker, pack_signs, save_layers, slice_layer, unpack_signs)


def random_layer(k=256, n=384, K=2, codebook="mcg", seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    t = {
        "trellis": torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), generator=g, dtype=torch.int32).to(torch.int16),
        "suh": (torch.rand(k, generator=g) * 0.02 - 0.01).half(),
        "svh": (torch.rand(n, generator=g) + 0.5).half(),
        **marker(codebook),
    }
    if bias:
        t["bias"] = torch.randn(n, generator=g).half()
    return t


def test_hadamard_is_orthonormal_and_sylvester():
    h = hadamard_128().double()
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    assert (h[5, 3] * 128 ** 0.5).item() == pytest.approx(-1.0)  # popcount(5 & 3) = 1


def test_decode_weight_matches_definition():
    t = random_layer()
    w_hat = decode_inner(t["trellis"], 2, "mcg").double()
    hk = torch.block_diag(*[hadamard_128(dtype=torch.float64)] * 2)
    hn = torch.block_diag(*[hadamard_128(dtype=torch.float64)] * 3)
    want = torch.diag(t["suh"].double()) @ hk @ w_hat @ hn @ torch.diag(t["svh"].double())
    got = decode_weight(t)
    assert got.dtype == torch.float32 and got.shape == (256, 384)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-7)


def test_had_rows_cols():
    x = torch.randn(256, 384, dtype=torch.float64)
    hk = torch.block_diag(*[hadamard_128(dtype=torch.float64)] * 2)
    hn = torch.block_diag(*[hadamard_128(dtype=torch.float64)] * 3)
    assert torch.allclose(had_rows(x), x @ hn) and torch.allclose(had_cols(x), hk @ x)


def test_legacy_sign_bitfields():
    t = random_layer()
    signs_u = torch.sign(torch.randn(256)).half()
    signs_v = torch.sign(torch.randn(384)).half()
    assert torch.equal(unpack_signs(pack_signs(signs_u)), signs_u)
    new = {**t, "suh": signs_u, "svh": signs_v}
    old = {k: v for k, v in t.items() if k not in ("suh", "svh")}
    old.update(su=pack_signs(signs_u), sv=pack_signs(signs_v))
    assert torch.equal(decode_weight(old), decode_weight(new))
    # bit b of word w (LSB first) is the sign of element 16w+b, 1 meaning -1
    assert unpack_signs(torch.tensor([0b101], dtype=torch.int16))[:3].tolist() == [-1.0, 1.0, -1.0]


def test_codebook_markers():
    assert decode_weight(random_layer(codebook="3inst")).shape == (256, 384)
    t = random_layer(codebook="mcg")
    with pytest.raises(FormatError, match="both"):
        check_layer({**t, **marker("mul1")})
    assert marker("mcg")["mcg"].item() == -877912083 and marker("mul1")["mul1"].item() == -2082680531


def test_safetensors_round_trip(tmp_path):
    layers = {"model.layers.0.mlp.experts.3.down_proj": random_layer(bias=True),
              "model.layers.0.mlp.experts.3.up_proj": random_layer(K=4, codebook="mul1", seed=1)}
    path = tmp_path / "shard.safetensors"
    save_layers(path, layers)
    assert not list(tmp_path.glob("*.tmp"))
    for key, want in layers.items():
        got = load_layer(path, key)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[s], want[s]) for s in want)
    with pytest.raises(FormatError, match="no tensors for module 'missing'"):
        load_layer(path, "missing")


def test_errors_name_the_tensor():
    t = random_layer()
    with pytest.raises(FormatError, match=r"q_proj\.svh: shape"):
        check_layer({**t, "svh": t["svh"][:100]}, "q_proj")
    with pytest.raises(FormatError, match=r"q_proj: not an EXL3 layer, missing \.suh"):
        check_layer({k: v for k, v in t.items() if k != "suh"}, "q_proj")
    with pytest.raises(FormatError, match=r"q_proj\.trellis"):
        check_layer({**t, "trellis": t["trellis"][..., :30]}, "q_proj")


def test_tensor_parallel_slices_recombine():
    t = random_layer(k=256, n=512, bias=True)
    w = decode_weight(t)
    cols = [slice_layer(t, "out", a, a + 256) for a in (0, 256)]
    assert torch.allclose(torch.cat([decode_weight(c) for c in cols], 1), w, rtol=1e-6, atol=1e-7)
    rows = [slice_layer(t, "in", a, a + 128) for a in (0, 128)]
    assert torch.allclose(torch.cat([decode_weight(r) for r in rows], 0), w, rtol=1e-6, atol=1e-7)
    assert "bias" in rows[0] and "bias" not in rows[1]
    assert torch.equal(torch.cat([c["bias"] for c in cols]), t["bias"])
    with pytest.raises(ValueError, match="multiples of 128"):
        slice_layer(t, "out", 0, 200)


def test_quant_config_round_trip():
    qc = QuantConfig(bits=2.0, codebook="mcg", version="0.1.0", original_quantization_config={"quant_method": "fp8"})
    d = qc.to_dict()
    assert d["quant_method"] == "exl3" and d["original_quantization_config"]["quant_method"] == "fp8"
    assert QuantConfig.from_dict(d) == qc
    ext = QuantConfig.from_dict({"quant_method": "exl3", "version": "1.4.2", "bits": 3.0, "head_bits": 4,
                                 "calibration": {"rows": 250, "cols": 2048}, "codebook": "mul1"})
    assert ext.codebook == "mul1" and ext.head_bits == 4
    with pytest.raises(ValueError, match="quant_method"):
        QuantConfig.from_dict({"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="codebook"):
        QuantConfig(bits=2, codebook="hyb", version="x")
