"""format.state_windows: where a decoder reading packed words finds each weight's state."""
import pytest
import torch

from xmoe.format import pack_states, state_windows, tile_perm, unpack_states


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 8, 1.5, 2.5, 3.5])
def test_windows_read_the_same_states_as_unpack(K):
    states = torch.randint(0, 65536, (4, 256), generator=torch.Generator().manual_seed(7))
    trellis = pack_states(states, K)
    ref = unpack_states(trellis, K)  # the tail-biting states the packed bits imply
    t = trellis.to(torch.int64) & 0xFFFF
    words = t[:, 0::2] | (t[:, 1::2] << 16)
    w = state_windows(K).long()
    lo, hi, shift = w & 0xFF, (w >> 8) & 0xFF, w >> 16
    assert int(shift.min()) >= 0 and int(shift.max()) <= 31
    natural = (((words[:, hi] << 32) | words[:, lo]) >> shift) & 0xFFFF  # indexed r*16 + c
    assert torch.equal(natural[:, tile_perm()], ref)
