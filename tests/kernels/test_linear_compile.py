"""torch.compile (vLLM compiles every model with it, fullgraph, no graph breaks allowed) must see an EXL3 dense
layer as one opaque op, `xmoe::exl3_linear`: its tracer cannot step into the kernels' host code (planning, the
tuning table's file, launch tables). On the CPU the op runs the torch reference; on a GPU the kernels, compiled
by inductor with CUDA graphs as vLLM runs them."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "format"))
from test_layer import random_layer  # noqa: E402

from xmoe.kernels.ops import Exl3Slices, Exl3Weight, exl3_linear, exl3_linear_op, register_linear  # noqa: E402


def layers(device: str):
    """(a single layer's index, a merged pair's index, the parts) on `device`."""
    parts = [Exl3Weight.from_tensors(random_layer(k=256, n=n, seed=i)).to(device) for i, n in enumerate((256, 128))]
    return register_linear([parts[0]]), register_linear(Exl3Slices.of(parts, "qkv")), parts


def model(single: int, merged: int, backend: str):
    def forward(x):
        one, two = exl3_linear_op(x, single, backend), exl3_linear_op(x, merged, backend)
        return one.float().sum(-1) + two[:, :7].float().sum(-1)
    return forward


def expected(x, parts, backend: str):
    return exl3_linear(x, parts[0], backend=backend).float().sum(-1) + torch.cat(
        [exl3_linear(x, w, backend=backend) for w in parts], -1)[:, :7].float().sum(-1)


def test_one_layer_and_merged_slices_compile_as_one_op_each():
    single, merged, parts = layers("cpu")
    x = torch.randn(5, 256)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    got = torch.compile(model(single, merged, "torch"), backend=backend, fullgraph=True)(x)
    ops = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.xmoe.exl3_linear.default) == 2
    torch.testing.assert_close(got, expected(x, parts, "torch"), rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
def test_inductor_then_a_captured_cuda_graph_equal_eager_on_the_gpu():
    """As vLLM runs a model: compiled by inductor, called once eagerly (its profiling run; the kernels' device
    tables are made then), then captured in a CUDA graph and replayed on new inputs."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    single, merged, parts = layers("cuda")
    compiled = torch.compile(model(single, merged, "triton"), fullgraph=True)
    for rows in (1, 5):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.float16)
        torch.testing.assert_close(compiled(x), expected(x, parts, "triton"), rtol=1e-4, atol=1e-3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = compiled(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y, expected(x, parts, "triton"), rtol=1e-4, atol=1e-3)


def test_a_registered_layer_is_released_with_its_owner():
    """A process that loads and drops models one after another must not keep every one's weights alive."""
    import gc

    from xmoe.kernels import ops

    class Layer:
        pass

    owner = Layer()
    index = register_linear([Exl3Weight.from_tensors(random_layer(k=256, n=128, seed=3))], owner=owner)
    x = torch.randn(2, 256)
    assert exl3_linear_op(x, index, "torch").shape == (2, 128)
    del owner
    gc.collect()
    assert index not in ops._KERNELS
