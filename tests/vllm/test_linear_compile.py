"""vLLM compiles the model with torch.compile (fullgraph, no graph breaks allowed). An EXL3 dense layer must reach
the compiled graph as one opaque op: the tracer must not step into the kernels' host code (planning, the tuning
table's file, launch tables), which it cannot trace. The GPU counterpart is test_serve_gpu.py's dense model,
served with CUDA graphs."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "format"))
from test_layer import random_layer  # noqa: E402

from xmoe.kernels.ops import Exl3Slices, Exl3Weight, exl3_linear  # noqa: E402
from xmoe.vllm.linear import exl3_linear_op, register_kernel  # noqa: E402


def test_one_layer_and_merged_slices_compile_as_one_op_each():
    parts = [Exl3Weight.from_tensors(random_layer(k=256, n=n, seed=i)) for i, n in enumerate((256, 128))]
    single, merged = register_kernel([parts[0]]), register_kernel(Exl3Slices.of(parts, "qkv"))
    x = torch.randn(5, 256, dtype=torch.float32)

    def layers(x):
        return exl3_linear_op(x, single, "torch").sum(-1) + exl3_linear_op(x, merged, "torch")[:, :7].sum(-1)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    got = torch.compile(layers, backend=backend, fullgraph=True)(x)
    ops = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.xmoe.exl3_linear.default) == 2
    want = exl3_linear(x, parts[0], backend="torch").sum(-1) + torch.cat(
        [exl3_linear(x, w, backend="torch") for w in parts], -1)[:, :7].sum(-1)
    torch.testing.assert_close(got, want)
