"""The Triton Viterbi kernels against the torch reference: on the CPU under TRITON_INTERPRET=1 (in a
subprocess, since the variable must be set before Triton compiles anything) and natively on a GPU."""
import os
import subprocess
import sys

import pytest
import torch

CASES = [(2, "mcg"), (3, "mul1"), (4, "3inst"), (6, "mcg")]


def _tiles(n: int, codebook: str, device: str, seed: int) -> torch.Tensor:
    from xmoe.format import codebook_table

    std = codebook_table(codebook).float().std()
    return (torch.randn(n, 256, generator=torch.Generator().manual_seed(seed)) * std).to(device)


def _errors(tiles, states, codebook):
    from xmoe.format import codebook_table

    return ((codebook_table(codebook, tiles.device).float()[states] - tiles) ** 2).sum(1)


def compare(K: int, codebook: str, device: str, nodes: int) -> None:
    """The fp32 kernel: the same search as the reference, so the same path cost."""
    from xmoe.format import check_tail_biting
    from xmoe.quant.viterbi import viterbi_torch
    from xmoe.quant.viterbi_triton import viterbi_triton

    tiles = _tiles(3, codebook, device, K)
    got = viterbi_triton(tiles, K, codebook, nodes=nodes, half=False)
    assert check_tail_biting(got, K)
    err_ref, err_got = _errors(tiles, viterbi_torch(tiles, K, codebook), codebook), _errors(tiles, got, codebook)
    # states may differ only where two paths tie exactly
    assert torch.allclose(err_got, err_ref, rtol=1e-5, atol=1e-6), (err_got, err_ref)


def compare_half(K: int, codebook: str, device: str, n: int, waves: bool) -> None:
    """The fp16-pair kernels: closed paths whose error is the reference's up to fp16 cost rounding
    (which moves single tiles by up to a few percent either way, the sum by far less), over several waves
    of tiles when `waves` (scratch for one program per SM at a time)."""
    from xmoe.format import check_tail_biting
    from xmoe.quant.viterbi import viterbi_torch
    from xmoe.quant.viterbi_triton import viterbi_triton

    tiles = _tiles(n, codebook, device, 7)
    got = viterbi_triton(tiles, K, codebook, half=True, **({"scratch_bytes": 1} if waves else {}))
    assert check_tail_biting(got, K)
    err_ref, err_got = _errors(tiles, viterbi_torch(tiles, K, codebook), codebook), _errors(tiles, got, codebook)
    ratio = err_got / err_ref
    assert ratio.max() < 1.05, (ratio.max(), ratio.argmax())
    assert err_got.sum() / err_ref.sum() < 1.002, (err_got.sum(), err_ref.sum())


def _interpret(call: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_viterbi_triton as t; t.{call}"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]


# Under the interpreter each kernel runs once, at its cheapest K (a case costs about 2^K); the GPU runs every K. K is a compile-time constant of one source: the fp32 kernel's, and the fp16
# kernels' pairs (K=2); their single choices (K=3 and 4) on the GPU only.
@pytest.mark.parametrize("K,codebook", CASES[:1])
def test_interpreter_matches_reference(K, codebook):
    pytest.importorskip("triton")
    _interpret(f"compare({K}, {codebook!r}, 'cpu', 1 << 16)")


@pytest.mark.parametrize("K,codebook", [(2, "mcg")])
def test_interpreter_half_matches_reference(K, codebook):
    pytest.importorskip("triton")
    _interpret(f"compare_half({K}, {codebook!r}, 'cpu', 1, False)")  # one tile: waves of tiles on the GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("K,codebook", CASES + [(1, "mcg"), (5, "mul1"), (6, "3inst"), (7, "mcg"), (8, "mcg")])
def test_gpu_matches_reference(K, codebook):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    compare(K, codebook, "cuda", 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("codebook", ["mcg", "mul1", "3inst"])
@pytest.mark.parametrize("waves", [False, True])
def test_gpu_half_matches_reference(K, codebook, waves):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    compare_half(K, codebook, "cuda", 300, waves)
