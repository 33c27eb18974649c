"""A real-weights Mixture-of-Experts from a dense Llama-family model ("sparse upcycling").

Every routed expert of a layer starts as a copy of that layer's dense FFN; a seeded random router picks the
top-k experts per token and renormalises their weights, so the unquantized MoE computes exactly the dense
model for any routing. Once the experts are quantized (each copy with its own random signs), the routing
decides which differently-rounded copy a token sees: routing is non-trivial yet deterministic.
Written in the Mixtral layout (`block_sparse_moe.experts.E.w1/w3/w2`) that vLLM and transformers both load.
"""
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from .source import SMOLLM2_SAMPLING
from .template import CHAT_TEMPLATE

# dense FFN projection -> Mixtral expert projection
EXPERT_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# A reply's default length in tokens when a request gives no max_tokens: a few paragraphs. Without it a
# request may run on until the context is full (and a small model sampled freely rarely stops by itself).
REPLY_TOKENS = 256
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
               "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act")


@dataclass(frozen=True)
class UpcycleSpec:
    experts: int = 4
    top_k: int = 2
    router_seed: int = 0
    dtype: str = "bfloat16"  # of the written checkpoint

    def __post_init__(self):
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and experts={self.experts}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype {self.dtype!r}: expected bfloat16, float16 or float32")


def load_gguf(gguf: Path):
    """(tokenizer, fp32 dense model) de-quantized from a GGUF file by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if model.config.model_type != "llama":
        raise ValueError(f"{gguf}: expected a llama-architecture model, got {model.config.model_type!r}")
    return tok, model


def moe_config(dense: dict, spec: UpcycleSpec) -> dict:
    """config.json of the MoE: the dense model's shape plus the expert count and routing."""
    missing = [k for k in CONFIG_KEYS if k not in dense]
    if missing:
        raise ValueError(f"dense config: missing {', '.join(missing)}")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            **{k: dense[k] for k in CONFIG_KEYS}, "num_local_experts": spec.experts,
            "num_experts_per_tok": spec.top_k, "router_aux_loss_coef": 0.0, "output_router_logits": False,
            "sliding_window": None, "attention_dropout": 0.0, "dtype": spec.dtype}


def generation_config_text(config: dict) -> str:
    """generation_config.json: the special tokens, the source model's recommended sampling and a default reply
    length. vLLM takes these as the defaults of every request that does not set them (its
    `--generation-config auto`), so a client that sends no sampling settings gets the model's own."""
    tokens = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return json.dumps({**tokens, **SMOLLM2_SAMPLING, "max_new_tokens": REPLY_TOKENS}, indent=2) + "\n"


def moe_tensors(dense: dict[str, torch.Tensor], hidden: int, spec: UpcycleSpec) -> dict[str, torch.Tensor]:
    """Mixtral tensors from a dense Llama state dict (lm_head left out when tied: it is the embedding)."""
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(spec.router_seed)
    out = {}
    for name, t in sorted(dense.items()):
        prefix, _, proj = name.removesuffix(".weight").rpartition(".mlp.")
        if proj in EXPERT_PROJ:
            for e in range(spec.experts):
                out[f"{prefix}.block_sparse_moe.experts.{e}.{EXPERT_PROJ[proj]}.weight"] = t.to(dtype).clone()
            if proj == "gate_proj":
                router = torch.randn(spec.experts, hidden, generator=gen) / hidden ** 0.5
                out[f"{prefix}.block_sparse_moe.gate.weight"] = router.to(dtype)
        else:
            out[name] = t.to(dtype).contiguous()
    return out


def write_upcycled(gguf: Path, dst: Path, spec: UpcycleSpec) -> dict:
    """Write the MoE checkpoint (config, weights, tokenizer, chat template) into the empty dir `dst`."""
    tok, model = load_gguf(gguf)
    dense_cfg = model.config.to_dict()
    state = model.state_dict()
    if dense_cfg["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    tensors = moe_tensors(state, dense_cfg["hidden_size"], spec)
    del model, state
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = moe_config(dense_cfg, spec)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dst / "generation_config.json").write_text(generation_config_text(config))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(dst)
    return {"upcycle": asdict(spec), "params": sum(t.numel() for t in tensors.values())}
