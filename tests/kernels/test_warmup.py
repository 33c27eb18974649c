"""The warm-up (kernels.warmup) of the fused MoE and of dense EXL3 layers: one call per distinct launch over
1..max_tokens tokens, so that a server compiles no kernel variant while requests wait. On a GPU, calls at other
counts after the warm-up compile nothing (Triton's post-compile hook counts); on the CPU, the counts it picks, and
the warm-up itself under the Triton interpreter, dense path included."""
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cases import random_experts, random_weight  # noqa: E402
from checks import run_interpreted  # noqa: E402

from xmoe.kernels.ops import (Exl3Slices, exl3_linear, exl3_linear_slices, fused_moe,  # noqa: E402
                              warm_up_linear, warm_up_moe)
from xmoe.kernels.plan import Target  # noqa: E402
from xmoe.kernels.tuning import DEFAULT  # noqa: E402
from xmoe.kernels.warmup import launch_key, linear_key, linear_sizes, plan_sizes, routings  # noqa: E402

H100 = Target(name="H100", sms=132, gpu=True, tma=True, shared_memory=232448)


def v41_rank() -> SimpleNamespace:
    """What planning reads of DeepSeek-V4.1's per-rank experts at TP2 (K=2 MCG)."""
    def w(n, k):
        return SimpleNamespace(n=n, k=k, K=2, codebook="mcg", experts=384)
    return SimpleNamespace(gate=w(1152, 5120), up=w(1152, 5120), down=w(5120, 1152), count=384)


def test_sizes_cover_every_launch_of_a_server_once():
    experts = v41_rank()
    sizes = plan_sizes(experts, 6, 8192, H100, DEFAULT)
    keys = [launch_key(n, 6, experts, H100, DEFAULT) for n in sizes]
    assert len(set(keys)) == len(keys) and sizes[0] == 1
    assert set(keys) == {launch_key(n, 6, experts, H100, DEFAULT) for n in range(1, 8193)}
    # mixed batches past vLLM's largest CUDA-graph size (32) reach new plans the start-up never launches
    assert [n for n in sizes if n > 32] and len(sizes) < 100


def test_linear_sizes_cover_every_row_count():
    w = SimpleNamespace(n=2304, k=5120, K=2, codebook="mcg", experts=0)
    sizes = linear_sizes(w, 1, 4096, H100, DEFAULT)
    assert sizes[0] == 1 and 16 in sizes and len(sizes) < 100
    keys = [linear_key(n, w, 1, H100, DEFAULT) for n in sizes]
    assert len(set(keys)) == len(keys)
    assert set(keys) == {linear_key(n, w, 1, H100, DEFAULT) for n in range(1, 4097)}


def test_routings_spread_and_mixed():
    g = torch.Generator().manual_seed(0)
    spread, = routings(10, 3, 16, False, g)
    assert spread.shape == (10, 3) and all(len(set(row.tolist())) == 3 for row in spread)
    spread, mixed = routings(10, 3, 16, True, g)
    assert (mixed[:5] == torch.arange(3)).all() and torch.equal(mixed[5:], spread[5:])


def warm_small() -> None:
    experts = random_experts(8, 128, 128, 2, "mcg")
    tuning = replace(DEFAULT, dense_rows=4)  # experts of 4 rows and more go dense: the dense path runs too
    sizes = warm_up_moe(experts, 2, 12, torch.float32, ids_dtype=torch.int64, tuning=tuning)
    assert sizes[0] == 1 and len(sizes) >= 4, sizes
    assert warm_up_moe(experts, 2, 12, torch.float32, ids_dtype=torch.int64, tuning=tuning) == []  # once


def warm_linear_small() -> None:
    q, k = random_weight(256, 256, 2, "mcg", seed=1), random_weight(256, 128, 2, "mcg", seed=2)
    tuning = replace(DEFAULT, dense_rows=8)  # the dense path from 8 rows
    assert warm_up_linear(Exl3Slices.of([q, k]), 20, torch.float32, tuning=tuning)[0] == 1
    assert warm_up_linear([q], 20, torch.float32, tuning=tuning)
    assert warm_up_linear([q], 20, torch.float32, tuning=tuning) == []


def test_warm_up_under_interpreter():
    pytest.importorskip("triton")
    run_interpreted(warm_small)
    run_interpreted(warm_linear_small)


@pytest.mark.gpu
def test_no_kernel_compiles_after_warm_up():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from triton import knobs
    experts = random_experts(64, 512, 256, 2, "mcg", device="cuda")
    warm_up_moe(experts, 6, 700, torch.bfloat16)
    compiled, hook = [], knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(kwargs.get("fn", args))
    try:
        for tokens in range(1, 701, 9):
            x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(tokens, 64, device="cuda").argsort(-1)[:, :6].int()
            fused_moe(x, ids, torch.full((tokens, 6), 1 / 6, device="cuda"), experts, backend="triton")
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = hook
    assert not compiled, compiled[:5]


@pytest.mark.gpu
def test_no_dense_layer_compiles_after_warm_up():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from triton import knobs
    q, k = (random_weight(1024, n, 3, "mcg", seed=n, device="cuda") for n in (1024, 256))
    qk, single = Exl3Slices.of([q, k]), [k]
    warm_up_linear(qk, 600, torch.float16)
    warm_up_linear(single, 600, torch.float16)
    compiled, hook = [], knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(kwargs.get("fn", args))
    try:
        for rows in range(1, 601, 11):
            x = torch.randn(rows, 1024, device="cuda", dtype=torch.float16)
            exl3_linear_slices(x, qk, backend="triton")
            exl3_linear(x, k, backend="triton")
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = hook
    assert not compiled, compiled[:5]


OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")  # compile options: by value


def specialization(fn, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a launch of `fn` for, as its JIT specializes: constexprs by value, integers on being 1
    and divisible by 16, pointers on their dtype and 16-byte alignment, plus the launch options."""
    import inspect
    params = inspect.signature(fn.fn).parameters
    key = [fn.__name__]
    for name, v in {**dict(zip(params, args)), **kwargs}.items():
        constexpr = name in params and "constexpr" in str(params[name].annotation)
        if constexpr or name in OPTIONS or isinstance(v, (bool, str)) or v is None:
            key.append((name, v))
        elif isinstance(v, torch.Tensor):
            key.append((name, v.dtype, v.data_ptr() % 16 == 0))
        elif isinstance(v, int):
            key.append((name, v == 1, v % 16 == 0))
        else:
            key.append((name, type(v).__name__))
    return tuple(key)


def launches_after_warm_up(max_tokens: int) -> None:
    """Under the interpreter: every launch fused_moe makes at 1..max_tokens tokens, spread or skewed, has a
    specialization the warm-up already launched (on a GPU, one it compiled)."""
    from triton.runtime.interpreter import InterpretedFunction
    seen, run = set(), InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        seen.add(specialization(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    experts = random_experts(8, 128, 128, 2, "mcg")
    tuning = replace(DEFAULT, dense_rows=4)
    warm_up_moe(experts, 2, max_tokens, torch.float32, tuning=tuning)
    warm, g = set(seen), torch.Generator().manual_seed(1)
    for tokens in range(1, max_tokens + 1):
        x = torch.randn(tokens, 128, generator=g)
        for ids in routings(tokens, 2, 8, True, g):
            fused_moe(x, ids.int(), torch.full((tokens, 2), 0.5), experts, backend="triton", tuning=tuning)
    new = [(key[0], sorted({item for w in warm if w[0] == key[0] for item in set(key) ^ set(w)}, key=str)[:6])
           for key in seen - warm]
    assert not new, new[:4]  # each new launch with what differs from the warm-up's launches of its kernel


def test_warm_up_leaves_no_specialization_unlaunched():
    pytest.importorskip("triton")
    run_interpreted(launches_after_warm_up, 20)
