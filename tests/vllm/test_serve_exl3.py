"""vLLM's OpenAI server on tiny EXL3 checkpoints, on the CPU: greedy completions must equal a transformers
forward pass on the weights the checkpoint decodes to, token for token."""
import pytest
from serving import PROMPTS, check_served

from checkpoints import SERVE_BASE, save_exl3_dense, save_hf  # noqa: I001 (put on sys.path by serving)
from xmoe.quant.convert import convert
from xmoe.quant.plan import ConvertOptions


def test_qwen3_moe_experts(tmp_path):
    src = save_hf("qwen3_moe", tmp_path / "src", base=SERVE_BASE)
    convert(src, tmp_path / "dst", ConvertOptions(bits=3, encoder="beam", beam_width=16), ["cpu"])
    check_served(src, tmp_path / "dst")


def test_dense_llama_all_linears(tmp_path):
    src = save_hf("llama", tmp_path / "src", base=SERVE_BASE)
    check_served(src, save_exl3_dense(src, tmp_path / "dst", K=4))


def test_kernel_path_under_triton_interpreter(tmp_path):
    """The GPU path (weights kept as EXL3, the Triton linear and fused-MoE kernels) inside vLLM, with Triton
    emulating the GPU on the CPU: a Qwen3-MoE whose routed experts are EXL3."""
    pytest.importorskip("triton")
    src = save_hf("qwen3_moe", tmp_path / "src", base=SERVE_BASE)
    convert(src, tmp_path / "moe", ConvertOptions(bits=3, encoder="beam", beam_width=16), ["cpu"])
    check_served(src, tmp_path / "moe", env={"TRITON_INTERPRET": "1"},
                 prompts=PROMPTS[:2], n=4)  # every interpreted step is slow: fewer than the torch path's


def test_dense_llama_kernel_path_under_triton_interpreter(tmp_path):
    """The GPU path of a dense model whose every linear is EXL3, under the Triton interpreter: outputs of whole
    128-column blocks, so q, k and v run as one set of launches, and gate and up as another (Exl3Slices)."""
    pytest.importorskip("triton")
    base = dict(SERVE_BASE, hidden_size=256, intermediate_size=256)  # head_dim 128: q 256, k and v 128
    src = save_hf("llama", tmp_path / "src", base=base)
    # two prompts, four tokens: every interpreted step runs all seven linears of both layers
    check_served(src, save_exl3_dense(src, tmp_path / "dst", K=4), env={"TRITON_INTERPRET": "1"},
                 prompts=PROMPTS[:2], n=4)


def test_qwen3_moe_tensor_parallel_2(tmp_path):
    """TP=2 on vLLM's CPU backend: each rank takes its half of every expert's intermediate dimension."""
    src = save_hf("qwen3_moe", tmp_path / "src", base=SERVE_BASE)
    convert(src, tmp_path / "dst", ConvertOptions(bits=3, encoder="beam", beam_width=16), ["cpu"])
    check_served(src, tmp_path / "dst", "--tensor-parallel-size", "2")


def test_qwen3_moe_expert_parallel_2(tmp_path):
    """TP=2 with expert parallelism on vLLM's CPU backend: each rank loads only its half of the experts, whole,
    and computes the tokens routed to them; vLLM sums the two ranks' outputs."""
    src = save_hf("qwen3_moe", tmp_path / "src", base=SERVE_BASE)
    convert(src, tmp_path / "dst", ConvertOptions(bits=3, encoder="beam", beam_width=16), ["cpu"])
    check_served(src, tmp_path / "dst", "--tensor-parallel-size", "2", "--enable-expert-parallel")
