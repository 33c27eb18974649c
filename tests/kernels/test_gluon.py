"""grouped_mma (Gluon) on any machine: its index arithmetic replayed in torch against the format, and the kernel
compiled for sm_90 and sm_80 (Triton compiles without a GPU). The kernel asserts at compile time that no value
moves between threads on its way into the MMA, so a layout that would need shared memory or shuffles fails here.
Its numbers are checked on a GPU by test_ops.py (the `tiled-mma` cases) against the torch reference."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from xmoe.format.codebook import codebook_table
from xmoe.format.trellis import tile_perm, unpack_states

gluon = pytest.importorskip("triton.experimental.gluon")

sys.path.insert(0, str(Path(__file__).parent))
from cubins import compile_gluon, resources  # noqa: E402

from xmoe.kernels import gluon_mma, triton_codebook  # noqa: E402
from xmoe.kernels.gluon_mma import decode_weights, grouped_mma  # noqa: E402
from xmoe.kernels.launch import CODEBOOK_ID  # noqa: E402
from xmoe.kernels.tuning import DEFAULT  # noqa: E402


def funnel(lo: int, hi: int, shift: int) -> int:
    return ((hi << 32 | lo) >> shift) & 0xFFFFFFFF


@pytest.mark.parametrize("K", [1, 1.5, 2, 2.5, 3, 3.5, 4])
def test_lane_states_match_the_format(K):
    """Lane L = 4 g + t, register q = 4 c3 + 2 j + r0 (gluon_mma.tile_layout): the state the kernel derives from
    the lane's word and its neighbour lanes', at the input row and column it assigns, is the format's."""
    W = int(8 * K)  # words a tile, bits a lane
    trellis = torch.randint(-32768, 32768, (2 * W,), generator=torch.Generator().manual_seed(W), dtype=torch.int16)
    t16 = trellis.to(torch.int64) & 0xFFFF
    words = (t16[0::2] | t16[1::2] << 16).tolist()
    states = unpack_states(trellis, K).tolist()
    KA, H = W // 8, W % 8 // 4
    FIRST = 4 * KA + 2 * H  # where the first window ends (other K than 1, 2, 4)

    def loaded(lane):  # the word a lane loads
        return (W * lane) // 32 if W in (8, 16, 32) else (W * lane + FIRST - 1) // 32

    for lane in range(32):
        g, t = divmod(lane, 4)
        word = loaded(lane)
        if W in (8, 16, 32):
            src = (lane + 32 - 32 // W) % 32
        else:
            src = (32 * ((word + W - 1) % W) + W - FIRST) // W
            second = (W * lane + W - 1) // 32
            later_lane = (32 * second + W - FIRST) // W
            assert loaded(later_lane) == second
        assert loaded(src) == (word - 1) % W
        lo, hi = words[word], words[loaded(src)]  # the shuffled neighbour's word
        for q in range(8):
            c3, j, r0 = q >> 2, (q >> 1) & 1, q & 1
            if W not in (8, 16, 32):
                end = W * lane + FIRST + (W - FIRST) * (q // 4)
                window = funnel(lo if q < 4 else words[second], hi if q < 4 or second == word else lo,
                                32 * ((end - 1) // 32 + 1) - end)
                up = (3 - q % 4) * KA + H * (2 - (q % 4 + 1) // 2)
                state = window & 0xFFFF if q % 4 == 3 else (window * (65536 >> up) & 0xFFFFFFFF) >> 16
            elif K == 2:  # the window moved up 2, 4, 6 or 0 bits, then two of its bytes: from bit 16, 8 or 0
                moved = funnel(lo, hi, 16 - 16 * (t & 1)) << 2 * ((q + 1) % 4) & 0xFFFFFFFF
                state = moved >> (16 if q < 3 else 8 if q < 7 else 0) & 0xFFFF
            else:
                state = funnel(lo, hi, 32 * (word + 1) - W * lane - W // 8 * (q + 1)) & 0xFFFF
            row, col = 8 * j + 2 * t + r0, 8 * c3 + g  # act_layout's input row of this MMA slot; the column
            assert tile_perm()[8 * lane + q] == 16 * row + col
            assert state == states[8 * lane + q], (lane, q)


def test_mul1_codewords_match_the_format():
    """gluon_mma.codewords' mul1 arithmetic replayed in numpy for every state: dp4a's 0x6400 + byte sum read as
    fp16 (1024 + b), one fp16 FMA with k_inv 0x1EEE and k_bias 0xC931 (exact in float64, then one rounding), is
    the format's weight; the high half, 0 x k_inv + 0, is zero."""
    x = (np.arange(65536, dtype=np.uint64) * 0x83DCD12D) & 0xFFFFFFFF
    h = 0x6400 + sum((x >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4))

    def fp16(bits):
        return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float64)

    weight = (fp16(h) * fp16(0x1EEE) + fp16(0xC931)).astype(np.float16)
    assert np.array_equal(weight.view(np.uint16), codebook_table("mul1").view(torch.int16).numpy().view(np.uint16))
    # grouped_mma leaves the FMA to the epilogue, whose constants are the same two fp16 values
    assert (triton_codebook.MUL1_K_INV.value, triton_codebook.MUL1_K_BIAS.value) == (fp16(0x1EEE), fp16(0xC931))


def test_tile_order_gives_rows_and_columns():
    """gluon_mma.TILE_ORDER (decode_weights' permute) puts tile_layout's weight (nt, c3, g, kt, j, r0, t) at row
    16 kt + 8 j + 2 t + r0 and column 16 nt + 8 c3 + g of its block, row-major (the layout's row and column are
    checked against the format above)."""
    TN, TK = 8, 2
    nt, c3, g, kt, j, r0, t = torch.meshgrid(*(torch.arange(s) for s in (TN, 2, 8, TK, 2, 2, 4)), indexing="ij")
    at = (16 * kt + 8 * j + 2 * t + r0) * 16 * TN + 16 * nt + 8 * c3 + g
    assert torch.equal(at.permute(*gluon_mma.TILE_ORDER.value).reshape(-1), torch.arange(256 * TN * TK))


POINTERS = {"a0_ptr": "*i32", "a1_ptr": "*i32", "chunk_pos_ptr": "*i32", "chunk_len_ptr": "*i32",
            "chunk_expert_ptr": "*i32", "n_chunks_ptr": "*i32", "t0_ptr": "*i32", "t1_ptr": "*i32",
            "p0_ptr": "*fp32", "p1_ptr": "*fp32"}
SCALARS = {"P": "i32", "k": "i32", "stride_te": "i32", "mask": "i32"}


def registers(TWO: bool, ROWS: int) -> int:
    """The registers the launcher gives a grouped_mma launch (0: the compiler's choice) of two streams (gate and
    up, or a pair of column blocks) or one."""
    return DEFAULT.mma_registers_wide if ROWS > 8 else DEFAULT.mma_registers_two if TWO else DEFAULT.mma_registers_one


def unroll(TWO: bool, ROWS: int) -> int:
    """The K steps a loop iteration the launcher gives a grouped_mma launch."""
    return 1 if ROWS > 8 else DEFAULT.mma_unroll_two if TWO else DEFAULT.mma_unroll_one


def idp(K: float, CB: int, ROWS: int) -> int:
    """The states the launcher has grouped_mma take by dp2a (none in chunks wider than 8 rows)."""
    return 0 if ROWS > 8 else DEFAULT.idp(int(8 * K), {v: k for k, v in CODEBOOK_ID.items()}[CB])


def compiled(K: int, CB: int, DUAL: bool, BN: int, BK: int, arch: int, ROWS: int = 8, PAIR: bool = False):
    const = dict(n=1152, W=int(8 * K), CB=CB, DUAL=DUAL, BN=BN, BK=BK, SPLIT=1, ROWS=ROWS,
                 UNROLL=unroll(DUAL or PAIR, ROWS), PAIR=PAIR, IDP=idp(K, CB, ROWS))
    registers_ = registers(DUAL or PAIR, ROWS)
    return compile_gluon(grouped_mma, {**POINTERS, **SCALARS}, const, arch, num_warps=4,
                         **({"maxnreg": registers_} if registers_ else {}))


ROWS_TILE = DEFAULT.mma_prefill  # grouped_mma in chunks of 32 rows
MID_TILE = DEFAULT.mma_mid  # dense layers of 9-16 rows: the same kernel at another tile


@pytest.mark.parametrize("K, CB, DUAL, BN, BK, arch, ROWS, PAIR", [(*case, False) for case in [
    (2, 1, True, 128, 32, 90, 8), (2, 0, True, 128, 32, 90, 8), (2, 1, False, 128, 32, 90, 8),
    (2, 0, False, 64, 64, 90, 8), (1, 1, True, 128, 32, 90, 8), (1, 0, False, 128, 32, 90, 8),
    (4, 0, True, 128, 32, 80, 8), (4, 1, False, 128, 32, 90, 8), (3, 1, True, 128, 32, 90, 8),
    (3, 0, False, 128, 32, 90, 8), (2, 2, True, 128, 32, 90, 8), (3, 2, False, 128, 32, 90, 8),
    (4, 2, True, 128, 32, 80, 8), (2.5, 2, True, 128, 32, 90, 8), (3.5, 2, False, 128, 32, 90, 8),
    (1.5, 2, False, 128, 32, 90, 8)] +
    [(K, CB, False, ROWS_TILE.BN, ROWS_TILE.BK, 90, ROWS_TILE.BM) for K, CB in ((2, 1), (2, 2), (3, 1), (4, 0),
                                                                               (2.5, 2), (3, 2))] +
    [(K, CB, False, MID_TILE.BN, MID_TILE.BK, 90, MID_TILE.BM) for K, CB in ((2, 1), (3, 2), (4, 0), (1.5, 2))]] +
    [(K, CB, False, 128, 32, 90, 8, True) for K, CB in ((2, 1), (2, 2), (3, 1), (4, 0), (1, 1), (2.5, 2), (3.5, 2))] +
    # workstation and Blackwell GPUs: Ampere and Ada (sm_86, sm_89), sm_100 and sm_120 (RTX 50 series)
    [(2, 1, True, 128, 32, arch, 8, False) for arch in (86, 89, 100, 120)] + [(3, 2, False, 128, 32, 120, 8, True)])
def test_grouped_mma_compiles_without_shared_memory(K, CB, DUAL, BN, BK, arch, ROWS, PAIR):
    kernel = compiled(K, CB, DUAL, BN, BK, arch, ROWS, PAIR)
    assert kernel.metadata.shared == 0, "a decoded weight went through shared memory"
    usage = resources(kernel.asm["cubin"])  # within the launcher's register limit, nothing spilled
    two = DUAL or PAIR
    assert usage["REG"] <= (registers(two, ROWS) or 255) and usage["STACK"] == usage["LOCAL"] == 0, usage
    ptx = kernel.asm["ptx"]
    mmas = ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")
    assert mmas == (2 * unroll(two, ROWS) - 1) * (1 + two) * (BN // 64) * (BK // 16) * 2 * (ROWS // 8), \
        "one MMA per 16 doubled K rows, warp tile and 8 rows, in each K step of the code (unrolled: 1 + 2)"
    assert "shfl.sync.idx.b32" in ptx and "ld.shared" not in ptx
    assert ("prmt.b32" in ptx) == (K == 2), "at K = 2 the byte-aligned states are picked by PRMT"
    assert ("dp2a.lo.u32.u32" in ptx) == (idp(K, CB, ROWS) != 0), "the tuning's mma_idp states are taken by dp2a"
    assert ("dp4a.u32.u32" in ptx) == (CB == 2), "mul1's byte sum"
    assert "fma.rn.f16x2" not in ptx, "mul1's fp16 FMA is the epilogue's (triton_epilogues.mul1_affine)"


def test_pair_loads_its_rows_once():
    """A pair of column blocks (PAIR) decodes two streams as gate and up do, from one set of rows: fewer loads
    than the dual launch, the same stores."""
    dual, pair = (compiled(2, 1, not paired, 128, 32, 90, PAIR=paired).asm["ptx"] for paired in (False, True))
    assert pair.count("ld.global") < dual.count("ld.global")
    assert pair.count("st.global") == dual.count("st.global") > 0


@pytest.mark.parametrize("K, CB, MUL1_H", [(2, 1, False), (3, 0, False), (4, 1, False), (3, 2, False), (2.5, 2, True),
                                           (2, 2, True)])
def test_decode_weights_compiles(K, CB, MUL1_H):
    """The dense path's decoder (gluon_mma.decode_weights): grouped_mma's lanes, stored in rows of 16 bytes; at
    mul1 with the codebook's fp16 FMA, or without it (MUL1_H, as the GEMMs take the weights)."""
    args = {"t_ptr": "*i32", "expert_ptr": "*i32", "out_ptr": "*fp16", "k": "i32", "n": "i32", "stride_te": "i32",
            "mask": "i32"}
    kernel = compile_gluon(decode_weights, args, dict(W=int(8 * K), CB=CB, BN=128, BK=32, STEPS=8, MUL1_H=MUL1_H), 90,
                           num_warps=4)
    usage = resources(kernel.asm["cubin"])
    assert usage["STACK"] == usage["LOCAL"] == 0, usage
    ptx = kernel.asm["ptx"]
    assert "shfl.sync.idx.b32" in ptx and "st.global.v4.b32" in ptx and "st.global.b16" not in ptx, "16-byte stores"
    assert ("fma.rn.f16x2" in ptx) == (CB == 2 and not MUL1_H), "mul1's fp16 FMA where the weights are the format's"
