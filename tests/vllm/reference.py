"""Reference greedy decoding with transformers on the weights an EXL3 checkpoint decodes to."""
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from xmoe.format import decode_weight
from xmoe.format.layer import shard_files

EXPERT = ".experts."


def exl3_tensors(dst: Path) -> dict[str, dict]:
    layers: dict[str, dict] = {}
    for name in shard_files(dst)[0]:
        with safe_open(str(dst / name), framework="pt") as f:
            for k in f.keys():
                key, _, suffix = k.rpartition(".")
                if suffix in ("trellis", "suh", "svh", "mcg", "mul1"):
                    layers.setdefault(key, {})[suffix] = f.get_tensor(k)
    return layers


def hf_key(key: str) -> str:
    """transformers' module name for a checkpoint key; DeepSeek's native `layers.N.ffn.` is `model.layers.N.mlp.`"""
    return "model." + key.replace(".ffn.", ".mlp.", 1) if key.startswith("layers.") else key


def set_decoded(model, key: str, w: torch.Tensor) -> None:
    """Write a decoded (in, out) weight into the transformers module that `key` names."""
    key = hf_key(key)
    if EXPERT not in key:
        lin = model.get_submodule(key)
        lin.weight.data = w[: lin.in_features, : lin.out_features].T.contiguous()
        return
    base, _, rest = key.partition(EXPERT)
    expert, proj = rest.split(".")
    experts = model.get_submodule(base + ".experts")
    e = int(expert)
    if proj in ("down_proj", "w2"):
        experts.down_proj.data[e] = w[: experts.down_proj.shape[2], : experts.down_proj.shape[1]].T
    else:
        inter = experts.gate_up_proj.shape[1] // 2
        rows = slice(0, inter) if proj in ("gate_proj", "w1") else slice(inter, 2 * inter)
        experts.gate_up_proj.data[e, rows] = w[: experts.gate_up_proj.shape[2], :inter].T


def reference_model(src: Path, dst: Path):
    """transformers' model of `src` in fp32 with every tensor that `dst` holds as EXL3 set to its decoding."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    for key, t in exl3_tensors(dst).items():
        set_decoded(model, key, decode_weight(t))
    return model


def served_ranks(src: Path, dst: Path, prompts: list[list[int]], served: list[list[int]]) -> list[torch.Tensor]:
    """For each served continuation, the rank of every served token among the reference's logits given the
    same prefix (teacher forcing; 0 where the reference would have picked it too)."""
    model, out = reference_model(src, dst), []
    for p, got in zip(prompts, served):
        with torch.no_grad():
            logits = model(torch.tensor([p + got])).logits[0, len(p) - 1:-1]
        out.append((logits > logits.gather(-1, torch.tensor(got)[:, None])).sum(-1))
    return out


def reference_tokens(src: Path, dst: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    model = reference_model(src, dst)
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def save_decoded(src: Path, dst: Path, out: Path) -> Path:
    """`src` with every module that `dst` holds as EXL3 replaced by its decoded weight, in the source dtype:
    the dense checkpoint that serving `dst` must be equivalent to."""
    out.mkdir(parents=True)
    tensors = {}
    for name in shard_files(src)[0]:
        tensors.update(load_file(str(src / name)))
    for key, t in exl3_tensors(dst).items():
        w = tensors[f"{key}.weight"]  # (out, in)
        tensors[f"{key}.weight"] = decode_weight(t)[: w.shape[1], : w.shape[0]].T.to(w.dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((src / "config.json").read_text())
    return out
