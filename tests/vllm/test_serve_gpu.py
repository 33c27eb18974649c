"""vLLM's OpenAI server on a GPU, with the plugin and xmoe's kernels: tiny EXL3 checkpoints made by
`xmoe quantize` on the GPU, served with CUDA graphs (and once eagerly), 64 greedy tokens per prompt, one request
at a time and all at once, checked against transformers in fp32 on the weights the checkpoint decodes to.

The GPU computes in fp16, the reference in fp32: over 64 tokens a near-tie (top two logits 0.001-0.02 apart
in these random models) or a routing flip changes a token now and then, and the continuations part ways from
there. So each served token is checked against the reference given the served prefix (teacher forcing): it must
be the reference's own choice at 90% of the positions or more and among its top three everywhere. In bf16 on the
CPU the same models agree at 95-100% of positions with a worst rank of 2; broken weights or kernels agree at
about 1 in 256. The CPU counterparts, exact at fp32, are test_serve_exl3.py (vLLM's CPU backend, and the same
kernels under the Triton interpreter)."""
import pytest
import torch
from serving import Server

from checkpoints import SERVE_BASE, save_exl3_dense, save_hf, save_word_tokenizer  # noqa: I001 (on sys.path via serving)
from reference import served_ranks
from xmoe.quant.convert import convert
from xmoe.quant.plan import ConvertOptions

pytestmark = pytest.mark.gpu
N = 64
PROMPTS = [[1, 5, 9, 13, 17], [3, 4, 5], [200, 100, 50, 25], [7] * 11, [42, 43]]
DEEPSEEK_MLA = dict(q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


@pytest.fixture(autouse=True)
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")


def quantized(arch: str, tmp_path, bits: float = 3, base: dict = SERVE_BASE):
    src = save_hf(arch, tmp_path / "src", base=base)
    dst = tmp_path / "dst"
    convert(src, dst, ConvertOptions(bits=bits, encoder="viterbi"), ["cuda:0"])
    save_word_tokenizer(dst, base["vocab_size"])
    return src, dst


def check(src, dst, *args: str):
    with Server(dst, *args, gpu=True) as server:
        one_by_one = server.greedy(dst, PROMPTS, N)
        together = server.greedy(dst, PROMPTS, N, concurrent=True)
        log = server.log_text()
    assert "exl3" in log and "Traceback" not in log
    for how, served in (("one by one", one_by_one), ("together", together)):
        for prompt, got, ranks in zip(PROMPTS, served, served_ranks(src, dst, PROMPTS, served)):
            assert len(got) == N, (how, prompt, got)
            agree = (ranks == 0).float().mean().item()
            assert agree >= 0.9 and ranks.max() <= 2, (how, prompt, agree, ranks.tolist())


@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_qwen3_moe(tmp_path, eager):
    src, dst = quantized("qwen3_moe", tmp_path)
    check(src, dst, *(["--enforce-eager"] if eager else []))


def test_deepseek_v3(tmp_path):
    """MLA attention, a dense first layer, a shared expert beside the EXL3 routed experts. vLLM's GPU attention
    takes MLA only at the head sizes of real models (DeepSeek's 128 + 64 rope, values 128, latent 512); the CPU
    test's tiny sizes stop its start-up. (MLA's keys are per head: transformers repeats them by heads / key-value
    heads, so the two must be equal.)"""
    base = dict(SERVE_BASE, num_attention_heads=16, num_key_value_heads=16, **DEEPSEEK_MLA)
    src, dst = quantized("deepseek_v3", tmp_path, bits=4, base=base)
    check(src, dst)


def test_dense_llama_all_linears(tmp_path):
    """Every linear EXL3: q, k, v and gate, up as column slices of one launch, o and down on their own."""
    base = dict(SERVE_BASE, hidden_size=256, intermediate_size=256)
    src = save_hf("llama", tmp_path / "src", base=base)
    dst = save_exl3_dense(src, tmp_path / "dst", K=4)
    save_word_tokenizer(dst, base["vocab_size"])
    check(src, dst)
