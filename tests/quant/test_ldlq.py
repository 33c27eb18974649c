import pytest
import torch

from xmoe.format import decode_weight
from xmoe.quant import quantize_linear
from xmoe.quant.hessian import HessianError, block_ldl, damped, proxy_error
from xmoe.quant.ldlq import LdlqSpec, error_curve, quantize_ldlq

BEAM = dict(encoder="beam", beam_width=16)


def skewed_inputs(n_in: int, rows: int = 2048, seed: int = 0) -> torch.Tensor:
    """Calibration inputs with a few loud channels and correlated ones, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(n_in) + 0.3 * torch.randn(n_in, n_in, generator=g) / n_in ** 0.5
    return torch.randn(rows, n_in, generator=g) @ mix * torch.exp(torch.randn(n_in, generator=g))


def output_error(tensors, weight, H) -> float:
    e = decode_weight(tensors)[: weight.shape[1], : weight.shape[0]] - weight.T
    return proxy_error(e, weight.T, H)


@pytest.mark.parametrize("K", [2, 3])
def test_identity_hessian_is_the_uncalibrated_path_bit_for_bit(K):
    """With H rotated by the weight's signs alone, an isotropic H leaves nothing for LDLQ to feed back."""
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(K)) * 0.02
    plain = quantize_linear(weight, K, "mcg", seed=3, **BEAM)
    calibrated, info = quantize_ldlq(weight, 4.5 * torch.eye(256), K, "mcg", seed=3, spec=LdlqSpec(scaled=False),
                                     **BEAM)
    assert plain.keys() == calibrated.keys()
    assert [k for k in plain if not torch.equal(plain[k], calibrated[k])] == []
    assert info["cholesky_retries"] == 0
    assert info["proxy_err"] == pytest.approx(output_error(plain, weight, torch.eye(256)))


@pytest.mark.parametrize("scaled", [False, True])
def test_skewed_hessian_lowers_the_output_error(scaled):
    n_out, n_in = 160, 200  # both padded: 256 x 256
    weight = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(1)) / n_in ** 0.5
    x = skewed_inputs(n_in)
    H = x.T @ x / x.shape[0]
    plain = output_error(quantize_linear(weight, 2, "mcg", seed=0, **BEAM), weight, H)
    t, info = quantize_ldlq(weight, H, 2, "mcg", seed=0, spec=LdlqSpec(scaled=scaled), **BEAM)
    assert info["proxy_err"] == pytest.approx(output_error(t, weight, H), rel=1e-6)
    assert info["proxy_err"] < 0.75 * plain, (info["proxy_err"], plain)


def test_refit_in_the_hessian_metric_helps():
    weight = torch.randn(128, 128, generator=torch.Generator().manual_seed(2)) / 128 ** 0.5
    x = skewed_inputs(128, seed=2)
    H = x.T @ x / x.shape[0]
    plain = quantize_ldlq(weight, H, 2, "mcg", refit=False, **BEAM)[1]["proxy_err"]
    assert quantize_ldlq(weight, H, 2, "mcg", **BEAM)[1]["proxy_err"] < plain


def test_block_ldl_factors_and_retries():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 48, generator=g, dtype=torch.float64)
    H = damped(a @ a.T, 64)  # rank 48 plus damping: positive definite
    L, retries = block_ldl(H)
    full = L + torch.eye(64, dtype=torch.float64)
    for i in range(4):  # L has zero diagonal blocks; with unit ones it is L of H = L D L^T
        full[16 * i:16 * i + 16, 16 * i:16 * i + 16] = torch.eye(16)
    D = torch.linalg.inv(full) @ H @ torch.linalg.inv(full).T
    off = D.clone()
    for i in range(4):
        off[16 * i:16 * i + 16, 16 * i:16 * i + 16] = 0
    assert retries == 0 and off.abs().max() < 1e-9 and torch.triu(L, 1).abs().max() == 0
    eye = torch.eye(64, dtype=torch.float64)
    indefinite = H - (1.02 * torch.linalg.eigvalsh(H)[0] + 1e-3) * eye  # slightly indefinite: damping repairs it
    assert block_ldl(indefinite)[1] > 0


def test_bad_hessian_names_the_tensor():
    w = torch.randn(32, 128)
    H = torch.eye(128)
    H[3, 3] = float("nan")
    with pytest.raises(HessianError, match=r"^layers\.0\.w1: Hessian contains inf or NaN$"):
        quantize_ldlq(w, H, 2, "mcg", name="layers.0.w1", **BEAM)
    with pytest.raises(HessianError, match=r"layers\.0\.w1: Hessian of shape \(64, 64\), expected \(128, 128\)"):
        quantize_ldlq(w, torch.eye(64), 2, "mcg", name="layers.0.w1", **BEAM)
    with pytest.raises(HessianError, match="no positive diagonal"):
        quantize_ldlq(w, torch.zeros(128, 128), 2, "mcg", name="layers.0.w1", **BEAM)


def test_error_curve_falls_with_K_and_tracks_the_full_encode():
    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(4)) / 16
    x = skewed_inputs(256, seed=4)
    H = x.T @ x / x.shape[0]
    curve = error_curve(weight, H, [1, 2, 3], "mcg", strips=4, **BEAM)
    assert curve[1] > curve[2] > curve[3] > 0
    full = quantize_ldlq(weight, H, 2, "mcg", refit=False, **BEAM)[1]["proxy_err"]
    assert 0.6 < curve[2] / full < 1.6, (curve, full)


@pytest.mark.gpu
def test_gpu_ldlq_with_the_triton_viterbi():
    """The calibrated path on a GPU: every strip through the Triton Viterbi, H work in float64 on the device."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    weight = torch.randn(160, 200, generator=torch.Generator().manual_seed(1)) / 200 ** 0.5
    x = skewed_inputs(200)
    H = x.T @ x / x.shape[0]
    plain = output_error(quantize_linear(weight.cuda(), 2, "mcg"), weight, H)
    t, info = quantize_ldlq(weight.cuda(), H.cuda(), 2, "mcg", backend="triton")
    assert all(v.device.type == "cpu" for v in t.values())
    assert info["proxy_err"] == pytest.approx(output_error(t, weight, H), rel=1e-5)
    assert info["proxy_err"] < 0.75 * plain, (info["proxy_err"], plain)
    same, _ = quantize_ldlq(weight.cuda(), H.cuda(), 2, "mcg", backend="triton")
    assert all(torch.equal(t[k], same[k]) for k in t)  # deterministic
