"""Tiny checkpoints for the converter tests, built offline: from transformers configs (random weights,
Hugging Face key names, several shards) or written by hand (DeepSeek native names, FP8, MXFP4, fused)."""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


# vLLM's CPU attention needs head_dim >= 32: the serving tests use this larger base.
SERVE_BASE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  vocab_size=256, initializer_range=0.2)  # peaked logits: no near-ties in greedy checks


def hf_config(arch: str, base: dict = BASE):
    import transformers as tf
    if arch == "llama":
        return tf.LlamaConfig(**{"intermediate_size": 192, **base},
                              head_dim=base["hidden_size"] // base["num_attention_heads"])
    if arch == "mixtral":
        return tf.MixtralConfig(**base, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**base, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                 num_experts_per_tok=2, head_dim=base["hidden_size"] // base["num_attention_heads"])
    if arch == "olmoe":
        return tf.OlmoeConfig(**base, intermediate_size=32, num_experts=4, num_experts_per_tok=2, eos_token_id=1,
                              pad_token_id=0)
    if arch == "deepseek_v3":
        mla = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        # DeepSeek-V3's own router keys, which transformers' config leaves out and vLLM reads: without them vLLM
        # routes by softmax and has no parameter for the checkpoint's e_score_correction_bias
        return tf.DeepseekV3Config(**{**mla, **base}, intermediate_size=96, moe_intermediate_size=32,
                                   n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                                   topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid")
    if arch == "deepseek_v4":
        # vLLM's V4 attention stores KV as fp8_ds_mla (448 fp8 + 64 bf16 rope dims): head_dim 512 is fixed.
        # Layer 0 routes by token hash (tid2eid), layer 1 by score; both attend through the sliding window.
        n = base["num_hidden_layers"]
        v4 = dict(head_dim=512, partial_rotary_factor=64 / 512, q_lora_rank=64, o_groups=2, o_lora_rank=64,
                  moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                  index_n_heads=2, index_head_dim=64, index_topk=16, hc_mult=2, sliding_window=128,
                  max_position_embeddings=256, layer_types=["sliding_attention"] * n,
                  mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1))
        return tf.DeepseekV4Config(**{**v4, **{k: v for k, v in base.items() if k != "num_key_value_heads"}})
    raise ValueError(arch)


def save_hf(arch: str, path: Path, seed: int = 0, base: dict = BASE) -> Path:
    """A random model of `arch` saved by transformers in several shards, plus a tokenizer-like file."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, base)).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="40KB")
    (path / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return path


def _e8m0(x: torch.Tensor) -> torch.Tensor:
    return (torch.log2(x).round() + 127).to(torch.uint8)


def fp8_with_scale(w: torch.Tensor, block: int, e8m0: bool = False) -> dict:
    """Block-scaled FP8 e4m3 as DeepSeek stores it: weight and a per-block multiplier."""
    out, inp = w.shape
    s = w.abs().reshape(out // block, block, inp // block, block).amax((1, 3)) / 448
    if e8m0:
        s = torch.exp2(torch.log2(s).ceil())
    q = (w / s.repeat_interleave(block, 0).repeat_interleave(block, 1)).to(torch.float8_e4m3fn)
    return {"weight": q, "scale": _e8m0(s) if e8m0 else s.float()}


def mxfp4(w: torch.Tensor) -> dict:
    """MXFP4: e2m1 codes (first value in the low nibble) and one e8m0 scale per 32 inputs."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    out, inp = w.shape
    s = torch.exp2(torch.log2(w.abs().reshape(out, inp // 32, 32).amax(-1) / 6).ceil())
    x = w / s.repeat_interleave(32, 1)
    idx = (x.abs()[..., None] - grid).abs().argmin(-1) + 8 * (x < 0)
    packed = (idx[:, 0::2] | (idx[:, 1::2] << 4)).to(torch.uint8)
    return {"weight": packed, "scale": _e8m0(s)}


def save_deepseek_native(path: Path, seed: int = 0) -> Path:
    """DeepSeek-V4.1 style: native names, MXFP4 routed experts, FP8 32x32 attention, an Engram table, a
    shared expert, a DSpark/MTP block (`mtp.0`) and an MTP layer at index num_hidden_layers."""
    g = torch.Generator().manual_seed(seed)
    H, I, E = 64, 64, 4
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    shards = [{}, {}]
    for layer in range(3):  # layer 2 == num_hidden_layers: an MTP layer, left alone
        t = shards[min(layer, 1)]
        for name, w in (("wq", rnd(H, H)), ("wo", rnd(H, H))):
            for k, v in fp8_with_scale(w, 32).items():
                t[f"layers.{layer}.attn.{name}.{k}"] = v
        t[f"layers.{layer}.ffn.gate.weight"] = rnd(E, H).to(torch.bfloat16)
        t[f"layers.{layer}.ffn.gate.bias"] = rnd(E).float()
        for e in range(E):
            for proj, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                for k, v in mxfp4(rnd(*shape)).items():
                    t[f"layers.{layer}.ffn.experts.{e}.{proj}.{k}"] = v
        for proj, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            t[f"layers.{layer}.ffn.shared_experts.{proj}.weight"] = rnd(*shape).to(torch.bfloat16)
        t[f"layers.{layer}.attn_norm.weight"] = torch.ones(H)
    shards[0]["layers.1.engram.table"] = rnd(256, 32).to(torch.float8_e4m3fn)
    shards[0]["layers.1.engram.table_scale"] = torch.ones(256)
    shards[1]["mtp.0.ffn.experts.0.w1.weight"] = rnd(I, H).to(torch.bfloat16)
    shards[1]["embed.weight"] = rnd(128, H).to(torch.bfloat16)
    return _write(path, shards, {
        "model_type": "deepseek_v4", "num_hidden_layers": 2, "n_routed_experts": E, "hidden_size": H,
        "moe_intermediate_size": I, "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}})


# transformers' DeepSeek-V4 names -> DeepSeek's own (transformers saves most of them already; it reads all).
_V4_NATIVE = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
              "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
              "model.hc_head.hc_scale": "hc_head_scale"}


def save_deepseek_v4(path: Path, seed: int = 0, base: dict = SERVE_BASE) -> Path:
    """A random DeepSeek-V4 in DeepSeek's own format, which vLLM reads and transformers reads too: native
    tensor names (`layers.N.ffn.experts.E.w1.weight`, `embed.weight`, `head.weight`) and a native config
    (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `topk_method`) instead of transformers'
    `layer_types` / `mlp_layer_types`."""
    from safetensors.torch import load_file
    tmp = save_hf("deepseek_v4", path.with_name(path.name + "-hf"), seed, base)
    tensors = {}
    for f in sorted(tmp.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    native = {_V4_NATIVE.get(k, k).removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm."): v
              for k, v in tensors.items()}
    config = json.loads((tmp / "config.json").read_text())
    n = config["num_hidden_layers"]
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "partial_rotary_factor"):
        config.pop(key)
    config.update(compress_ratios=[0] * n, num_hash_layers=1, qk_rope_head_dim=64, topk_method="noaux_tc",
                  expert_dtype="bf16")
    return _write(path, [native], config)


def save_fused_qwen3(path: Path, seed: int = 0) -> Path:
    """Qwen3-MoE with fused experts: gate_up_proj (E, 2I, H), down_proj (E, H, I), FP8 128x128 attention."""
    g = torch.Generator().manual_seed(seed)
    H, I, E = 64, 32, 4
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    t = {"model.embed_tokens.weight": rnd(128, H).to(torch.bfloat16)}
    for layer in range(2):
        p = f"model.layers.{layer}"
        t[f"{p}.mlp.experts.gate_up_proj"] = rnd(E, 2 * I, H).to(torch.bfloat16)
        t[f"{p}.mlp.experts.down_proj"] = rnd(E, H, I).to(torch.bfloat16)
        t[f"{p}.mlp.gate.weight"] = rnd(E, H).to(torch.bfloat16)
        for k, v in fp8_with_scale(rnd(128, 128), 128).items():
            t[f"{p}.self_attn.q_proj.{'weight' if k == 'weight' else 'weight_scale_inv'}"] = v
    return _write(path, [t], {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": E,
                              "hidden_size": H, "moe_intermediate_size": I})


def _write(path: Path, shards: list[dict], config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    return path


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose token i is the word `t<i>`, so prompts and outputs read as token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(cleanup=False)  # tokens joined by spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "bos_token": "t1", "eos_token": "t2",
        "model_max_length": 128, "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))


def save_exl3_dense(src: Path, dst: Path, K: float = 4) -> Path:
    """Every linear projection of a dense model as EXL3 (as exllamav3 packs dense models), the rest as is."""
    from safetensors.torch import load_file

    from xmoe.format import QuantConfig
    from xmoe.quant import quantize_linear
    dst.mkdir(parents=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    out = {}
    for name, t in sorted(tensors.items()):
        if name.endswith("_proj.weight"):
            key = name.removesuffix(".weight")
            # a narrow beam: these packs test the serving path, not the encoder's quality
            enc = quantize_linear(t.float(), K, "mcg", "beam", seed=len(out), beam_width=16)
            out.update({f"{key}.{s}": v for s, v in enc.items()})
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QuantConfig(bits=K, codebook="mcg", version="test").to_dict()
    (dst / "config.json").write_text(json.dumps(config))
    return dst
