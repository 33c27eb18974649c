import pytest
import torch

from xmoe.format import (check_tail_biting, decode_inner, matrix_to_tiles, pack_states, tile_perm,
                         tiles_to_matrix, unpack_states)

ALL_K = [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5]


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_exllamav3_ground_truth(vectors, K, codebook):
    trellis = torch.from_numpy(vectors[f"dec_K{K}_{codebook}_trellis"])
    want = torch.from_numpy(vectors[f"dec_K{K}_{codebook}_w"])
    got = decode_inner(trellis, K, codebook)
    assert got.dtype == torch.float16 and got.shape == want.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("K", ALL_K)
def test_pack_unpack_round_trip(K):
    gen = torch.Generator().manual_seed(int(K * 10))
    trellis = torch.randint(-32768, 32768, (7, int(16 * K)), generator=gen, dtype=torch.int32).to(torch.int16)
    states = unpack_states(trellis, K)
    assert states.shape == (7, 256) and int(states.min()) >= 0 and int(states.max()) < 65536
    assert check_tail_biting(states, K)
    assert torch.equal(pack_states(states, K), trellis)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 8])
def test_tail_biting_detects_broken_path(K):
    states = unpack_states(torch.zeros(1, 16 * K, dtype=torch.int16) + 0x1234, K)
    broken = states.clone()
    broken[0, 0] ^= 1 << 15  # change a bit the previous state fixed
    assert check_tail_biting(states, K) and not check_tail_biting(broken, K)


def test_k4_nibble_layout():
    # K=4: uint32 word m holds sym_8m .. sym_8m+7, sym_8m in the top nibble; int16 [2m+1] is the high half.
    syms = torch.arange(256) % 16
    states = torch.zeros(256, dtype=torch.int64)
    for p in range(256):
        for j in range(4):
            states[p] |= syms[(p - j) % 256] << (4 * j)
    t = pack_states(states[None], 4)[0].to(torch.int64) & 0xFFFF
    assert t[1].item() == 0x0123 and t[0].item() == 0x4567


def test_tile_order_is_mma_fragment():
    perm = tile_perm()
    assert sorted(perm.tolist()) == list(range(256))
    # lane 0 holds (0,0), (1,0), (8,0), (9,0), (0,8), (1,8), (8,8), (9,8)
    assert perm[:8].tolist() == [0, 16, 128, 144, 8, 24, 136, 152]
    w = torch.randn(48, 64)
    assert torch.equal(tiles_to_matrix(matrix_to_tiles(w), 48, 64), w)


def test_half_k_needs_mul1():
    with pytest.raises(ValueError, match="mul1"):
        decode_inner(torch.zeros(1, 1, 40, dtype=torch.int16), 2.5, "mcg")


def test_bad_trellis_shape():
    with pytest.raises(ValueError):
        decode_inner(torch.zeros(1, 1, 33, dtype=torch.int16), 2, "mcg")
