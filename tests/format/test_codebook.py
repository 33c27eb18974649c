import pytest
import torch

from xmoe.format import CODEBOOKS, codebook_table, codebook_values

# (state, 3inst, mcg, mul1) fp16 bit patterns from the format spec.
KNOWN = [
    (0x0000, 0x3A25, 0x3F60, 0xC2E8),
    (0x0001, 0xBB5B, 0x304E, 0x3921),
    (0x0002, 0x3B74, 0xBA13, 0xB72D),
    (0x1234, 0xC066, 0x3E0F, 0xB89E),
    (0x8000, 0xB7F8, 0xB915, 0xBAF2),
    (0xFFFF, 0xB110, 0x3ACD, 0xB936),
]


@pytest.mark.parametrize("i,codebook", list(enumerate(CODEBOOKS)))
def test_known_values(i, codebook):
    states = torch.tensor([row[0] for row in KNOWN])
    bits = codebook_values(states, codebook).view(torch.int16).to(torch.int64) & 0xFFFF
    assert bits.tolist() == [row[i + 1] for row in KNOWN]


@pytest.mark.parametrize("codebook,std,distinct", [("3inst", 1.24371, None), ("mcg", 1.24411, None),
                                                   ("mul1", 1.00031, 913)])
def test_table_statistics(codebook, std, distinct):
    t = codebook_table(codebook).float()
    assert t.shape == (65536,)
    assert abs(t.std().item() - std) < 2e-4
    if distinct:
        assert t.unique().numel() == distinct


def test_unknown_codebook():
    with pytest.raises(ValueError, match="unknown codebook"):
        codebook_table("hyb")
