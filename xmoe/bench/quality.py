"""`xmoe eval quality PACK --reference SRC`: what the EXL3 encoding costs, token by token. The unquantized
source is run over a text in windows; then the same model with the pack's EXL3 weights decoded into it. Per
predicted token: KL(source || pack) over the whole vocabulary, and the log-likelihood of the true next token
under each (perplexity). With `groups`, each contiguous group of layers is also swapped in alone, so the
table shows which layers the bits cost most (a guide for `xmoe quantize --bits-for`).

Two routes. This one (two model directories) is exact: KL over the whole vocabulary. Its price: the source
model must fit in this machine's memory (`device_map="auto"` spreads it over GPUs and CPU memory through
accelerate). For a model of hundreds of billions of parameters, serve the pack and its source with vLLM and
give their URLs instead (`served_quality.py`): the servers hold the weights, perplexity stays exact, and the
KL becomes a top-k estimate, because servers return only the top few log-probabilities per token."""
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..format import decode_weight, load_layer
from ..format.layer import shard_files

_LAYER = re.compile(r"\blayers\.(\d+)\.")
EXPERTS = ".experts."


@dataclass(frozen=True)
class QualityOptions:
    text: str
    tokens: int = 2048          # tokens of the text to score
    window: int = 512           # tokens per forward pass (each window starts fresh)
    groups: int = 0             # > 0: also swap in each of this many layer groups alone
    dtype: str = "float32"
    device_map: str | None = None

    def __post_init__(self):
        if self.window < 2 or self.tokens < self.window:
            raise ValueError(f"need 2 <= window <= tokens, got window {self.window}, tokens {self.tokens}")


def pack_layers(pack: Path) -> dict[str, tuple[Path, int | None]]:
    """{module key: (shard, layer index)} for every EXL3 module of the pack."""
    out = {}
    for name in shard_files(pack)[0]:
        with safe_open(str(pack / name), framework="pt") as f:
            for k in f.keys():
                if k.endswith(".trellis"):
                    key = k[: -len(".trellis")]
                    m = _LAYER.search(key)
                    out[key] = (pack / name, int(m.group(1)) if m else None)
    if not out:
        raise ValueError(f"{pack}: no EXL3 tensors (no *.trellis) in any shard; is it an xmoe/exllamav3 pack?")
    return out


def weight_slot(model, key: str) -> tuple[torch.Tensor, tuple]:
    """The parameter that module `key`'s weight lives in, and the index into it: an nn.Linear's weight (out,
    in), or one expert's slice of transformers' fused expert tensors (gate_up_proj (E, 2I, H), down_proj
    (E, H, I))."""
    try:
        lin = model.get_submodule(key)
    except AttributeError:
        lin = None
    if isinstance(lin, torch.nn.Linear):
        return lin.weight, ()
    base, sep, rest = key.partition(EXPERTS)
    parts = rest.split(".")
    if not sep or len(parts) != 2 or not parts[0].isdigit():
        raise ValueError(f"pack module {key!r} has no counterpart in the reference model")
    experts, e, proj = experts_module(model, base, key), int(parts[0]), parts[1]
    if proj in ("down_proj", "w2"):
        return experts.down_proj, (e,)
    inter = experts.gate_up_proj.shape[1] // 2
    rows = slice(0, inter) if proj in ("gate_proj", "w1") else slice(inter, 2 * inter)
    return experts.gate_up_proj, (e, rows)


def experts_module(model, base: str, key: str):
    """The fused experts module of a checkpoint's MoE block. Checkpoints may name the block differently from
    the loaded model (Mixtral's `block_sparse_moe` is `mlp` in transformers 5), so both are tried."""
    for block in (base, base.rpartition(".")[0] + ".mlp"):
        try:
            return model.get_submodule(block + ".experts")
        except AttributeError:
            continue
    raise ValueError(f"pack module {key!r}: no experts module at {base}.experts or its .mlp equivalent")


def swap(model, layers: dict[str, tuple[Path, int | None]], keys: list[str]) -> dict:
    """Write the decoded EXL3 weights of `keys` into the model; returns the originals for `restore`."""
    saved = {}
    for key in keys:
        param, idx = weight_slot(model, key)
        target = param.data[idx] if idx else param.data
        w = decode_weight(load_layer(layers[key][0], key))          # (in, out), padded
        out_f, in_f = target.shape
        saved[key] = target.clone()
        target.copy_(w[:in_f, :out_f].T.to(target.dtype))
    return saved


def restore(model, saved: dict) -> None:
    for key, orig in saved.items():
        param, idx = weight_slot(model, key)
        (param.data[idx] if idx else param.data).copy_(orig)


@torch.inference_mode()
def logprobs(model, windows: torch.Tensor, desc: str) -> torch.Tensor:
    """Log-softmax over the vocabulary, (windows, window - 1, vocab) float32 on the CPU."""
    dev = next(model.parameters()).device
    out = [torch.log_softmax(model(w[None].to(dev)).logits[0, :-1].float(), -1).cpu()
           for w in tqdm(windows, desc=desc, unit="window", file=sys.stderr)]
    return torch.stack(out)


def compare(ref: torch.Tensor, got: torch.Tensor, windows: torch.Tensor) -> dict:
    """KL(ref || got) per token, perplexities and top-1 agreement."""
    kl = (ref.exp() * (ref - got)).sum(-1).flatten()
    target = windows[:, 1:, None]
    nll_ref = -ref.gather(-1, target).flatten()
    nll_got = -got.gather(-1, target).flatten()
    return {"kl_mean": float(kl.mean()), "kl_median": float(kl.median()), "kl_p99": float(kl.quantile(0.99)),
            "kl_max": float(kl.max()), "ppl_reference": math.exp(float(nll_ref.mean())),
            "ppl": math.exp(float(nll_got.mean())),
            "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean()), "kl_per_token": kl.tolist()}


def layer_groups(layers: dict, n_layers: int, groups: int) -> list[tuple[str, list[str]]]:
    size = math.ceil(n_layers / groups)
    out = []
    for g in range(groups):
        lo, hi = g * size, min((g + 1) * size, n_layers) - 1
        keys = [k for k, (_, i) in layers.items() if i is not None and lo <= i <= hi]
        if keys:
            out.append((f"layers {lo}-{hi}", keys))
    return out


def evaluate(pack: str, reference: str, opts: QualityOptions) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    pack_dir, src = Path(pack), Path(reference)
    layers = pack_layers(pack_dir)
    tok = AutoTokenizer.from_pretrained(src if (src / "tokenizer_config.json").is_file() else pack_dir)
    ids = tok(Path(opts.text).read_text(errors="replace"), return_tensors="pt").input_ids[0]
    if len(ids) < opts.tokens:
        raise ValueError(f"{opts.text}: {len(ids)} tokens, fewer than the {opts.tokens} asked for")
    n_win = opts.tokens // opts.window
    windows = ids[: n_win * opts.window].reshape(n_win, opts.window)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, opts.dtype), device_map=opts.device_map)
    model.eval()
    ref = logprobs(model, windows, "reference")
    result = {"pack": pack, "reference": reference, "text": opts.text, "tokens_scored": windows[:, 1:].numel(),
              "window": opts.window, "exl3_modules": len(layers), "groups": []}
    n_layers = model.config.num_hidden_layers
    for name, keys in layer_groups(layers, n_layers, opts.groups) if opts.groups else []:
        saved = swap(model, layers, keys)
        stats = compare(ref, logprobs(model, windows, name), windows)
        restore(model, saved)
        result["groups"].append({"group": name, "modules": len(keys),
                                 **{k: v for k, v in stats.items() if k != "kl_per_token"}})
    swap(model, layers, list(layers))
    result.update(compare(ref, logprobs(model, windows, "pack"), windows))
    return result


def rows(result: dict) -> list[dict]:
    cols = ("kl_mean", "kl_median", "kl_p99", "ppl", "top1_agreement")
    out = [{"swapped": g["group"], "modules": g["modules"], **{c: g[c] for c in cols}} for g in result["groups"]]
    out.append({"swapped": "all (the pack)", "modules": result["exl3_modules"], **{c: result[c] for c in cols}})
    out.append({"swapped": "none (reference)", "modules": 0, "kl_mean": 0.0, "kl_median": 0.0, "kl_p99": 0.0,
                "ppl": result["ppl_reference"], "top1_agreement": 1.0})
    return out
