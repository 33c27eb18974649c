import pytest
import torch

from xmoe.format import check_layer, decode_weight
from xmoe.quant import ScaleSearch, quantize_linear

# Relative error bounds of quantize_linear on Gaussian weights with the beam encoder (width 64).
BEAM_BOUND = {2: 0.10, 3: 0.028, 4: 0.0095}


def rel_err(tensors, weight):
    w = decode_weight(tensors)[: weight.shape[1], : weight.shape[0]].T
    return float((w - weight).pow(2).sum() / weight.pow(2).sum())


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("shape", [(7, 33), (300, 200), (128, 256)])
def test_quantize_then_decode(K, shape):
    g = torch.Generator().manual_seed(K)
    weight = torch.randn(*shape, generator=g) * 0.02
    weight[:, 1] *= 20  # an outlier input channel
    t = quantize_linear(weight, K, "mcg", "beam", seed=1)
    k, n, stored_K = check_layer(t)
    assert (k, n, stored_K) == (-(-shape[1] // 128) * 128, -(-shape[0] // 128) * 128, K)
    assert t["trellis"].dtype == torch.int16 and t["suh"].dtype == torch.float16 and "mcg" in t
    assert rel_err(t, weight) < BEAM_BOUND[K]


def test_viterbi_layer_beats_beam_layer():
    weight = torch.randn(128, 128, generator=torch.Generator().manual_seed(3))
    quick = ScaleSearch(grid=(0.95, 1.0, 1.05), sample_tiles=8)
    vit = rel_err(quantize_linear(weight, 2, "mcg", "viterbi", search=quick), weight)
    beam = rel_err(quantize_linear(weight, 2, "mcg", "beam", search=quick), weight)
    assert vit < 0.075 and vit < beam


@pytest.mark.parametrize("codebook", ["3inst", "mul1"])
def test_codebooks(codebook):
    weight = torch.randn(256, 128, generator=torch.Generator().manual_seed(5))
    t = quantize_linear(weight, 3, codebook, "beam")
    assert ("mul1" in t) == (codebook == "mul1") and "mcg" not in t
    assert rel_err(t, weight) < BEAM_BOUND[3]


def test_deterministic_and_seeded():
    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(9))
    a, b = (quantize_linear(weight, 2, "mcg", "beam", seed=4) for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = quantize_linear(weight, 2, "mcg", "beam", seed=5)
    assert not torch.equal(a["suh"].sign(), c["suh"].sign())


def test_refit_helps_and_zero_columns_stay_zero():
    weight = torch.randn(256, 128, generator=torch.Generator().manual_seed(2))
    weight[17] = 0  # an all-zero output channel
    plain = quantize_linear(weight, 2, "mcg", "beam", refit=False)
    refit = quantize_linear(weight, 2, "mcg", "beam")
    assert rel_err(refit, weight) < rel_err(plain, weight)
    assert decode_weight(refit)[:, 17].abs().max() == 0


def test_bad_weight():
    with pytest.raises(ValueError, match="2-D"):
        quantize_linear(torch.zeros(4), 2, "mcg")
    with pytest.raises(ValueError, match="NaN"):
        quantize_linear(torch.full((8, 8), float("nan")), 2, "mcg")
