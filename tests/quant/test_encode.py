
import pytest
import torch

from xmoe.format import check_tail_biting, codebook_table, pack_states, unpack_states
from xmoe.quant import encode_tiles

# Normalised MSE bounds on i.i.d. Gaussian tiles at the codebook's std (few tiles, so a little slack).
# exllamav3's own encoder gives 0.0682 / 0.0175 / 0.0047 for MCG at K = 2 / 3 / 4.
VITERBI_BOUND = {2: 0.0715, 3: 0.0185, 4: 0.0050}
BEAM_BOUND = {2: 0.095, 3: 0.027, 4: 0.0092}


def gaussian_tiles(T, codebook, seed=0):
    std = codebook_table(codebook).float().std()
    return torch.randn(T, 256, generator=torch.Generator().manual_seed(seed)) * std


def nmse(values, tiles):
    return float(((values - tiles) ** 2).sum() / (tiles ** 2).sum())


def check_states(values, states, K, codebook):
    s = states.to(torch.int64) & 0xFFFF
    assert states.dtype == torch.int16 and check_tail_biting(s, K)
    assert torch.equal(unpack_states(pack_states(s, K), K), s)  # packing keeps every state
    assert torch.equal(codebook_table(codebook)[s].float(), values)


@pytest.mark.parametrize("K", [2, 3, 4])
def test_viterbi_quality(K):
    tiles = gaussian_tiles(24, "mcg", seed=K)
    values, states = encode_tiles(tiles, K, "mcg", "viterbi")
    check_states(values, states, K, "mcg")
    assert nmse(values, tiles) < VITERBI_BOUND[K]


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("codebook", ["mcg", "mul1"])
def test_beam_quality(K, codebook):
    tiles = gaussian_tiles(64, codebook, seed=K)
    values, states = encode_tiles(tiles, K, codebook, "beam")
    check_states(values, states, K, codebook)
    assert nmse(values, tiles) < BEAM_BOUND[K]


# Only the Viterbi search is exact. mul1 has 913 distinct values (~72 states each), so ties can push the
# exact path out of a beam: the beam is checked on the codebooks whose values are nearly all distinct.
LOSSLESS = [("viterbi", K, cb) for K, cb in [(1, "3inst"), (2, "mul1"), (3, "mcg"), (5, "mcg"), (8, "mul1"),
                                             (2.5, "mul1")]] + [("beam", 1, "3inst"), ("beam", 3, "mcg"),
                                                                ("beam", 5, "mcg"), ("beam", 8, "3inst")]


@pytest.mark.parametrize("encoder,K,codebook", LOSSLESS)
def test_exactly_representable_input_is_lossless(encoder, K, codebook):
    g = torch.Generator().manual_seed(7)
    trellis = torch.randint(-32768, 32768, (4, int(16 * K)), generator=g, dtype=torch.int32).to(torch.int16)
    tiles = codebook_table(codebook)[unpack_states(trellis, K)].float()
    values, states = encode_tiles(tiles, K, codebook, encoder)
    check_states(values, states, K, codebook)
    assert torch.equal(values, tiles)


def test_viterbi_beats_beam():
    tiles = gaussian_tiles(16, "mcg", seed=11)
    assert nmse(encode_tiles(tiles, 2, "mcg", "viterbi")[0], tiles) < nmse(encode_tiles(tiles, 2, "mcg", "beam")[0], tiles)


def test_bad_arguments():
    tiles = gaussian_tiles(2, "mcg")
    with pytest.raises(ValueError, match="unknown encoder"):
        encode_tiles(tiles, 2, "mcg", "greedy")
    with pytest.raises(ValueError, match="bits per weight"):
        encode_tiles(tiles, 9, "mcg")
    with pytest.raises(ValueError, match=r"\(T, 256\)"):
        encode_tiles(tiles[:, :100], 2, "mcg")
    with pytest.raises(ValueError, match="NaN"):
        encode_tiles(tiles * float("nan"), 2, "mcg")
    with pytest.raises(RuntimeError, match="not on a CUDA device"):
        encode_tiles(tiles, 2, "mcg", backend="triton")


