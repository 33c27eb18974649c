"""The Triton Viterbi against the torch reference: on the CPU under TRITON_INTERPRET=1 (in a subprocess,
since the variable must be set before Triton compiles anything) and natively on a GPU."""
import os
import subprocess
import sys

import pytest
import torch

CASES = [(2, "mcg"), (3, "mul1"), (4, "3inst"), (6, "mcg")]


def compare(K: int, codebook: str, device: str, nodes: int) -> None:
    from xmoe.format import check_tail_biting, codebook_table
    from xmoe.quant.viterbi import viterbi_torch
    from xmoe.quant.viterbi_triton import viterbi_triton

    std = codebook_table(codebook).float().std()
    tiles = (torch.randn(3, 256, generator=torch.Generator().manual_seed(K)) * std).to(device)
    ref = viterbi_torch(tiles, K, codebook)
    got = viterbi_triton(tiles, K, codebook, nodes=nodes)
    table = codebook_table(codebook, device).float()
    err_ref = ((table[ref] - tiles) ** 2).sum(1)
    err_got = ((table[got] - tiles) ** 2).sum(1)
    assert check_tail_biting(got, K)
    # Same search, so the same path cost; states may differ only where two paths tie exactly.
    assert torch.allclose(err_got, err_ref, rtol=1e-5, atol=1e-6), (err_got, err_ref)


@pytest.mark.parametrize("K,codebook", CASES)
def test_interpreter_matches_reference(K, codebook):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); " \
           f"from test_viterbi_triton import compare; compare({K}, {codebook!r}, 'cpu', 1 << 16)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("K,codebook", CASES + [(1, "mcg"), (5, "mul1"), (6, "3inst"), (7, "mcg"), (8, "mcg")])
def test_gpu_matches_reference(K, codebook):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    compare(K, codebook, "cuda", 4096)
