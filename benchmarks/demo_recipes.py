"""KL and perplexity of bit recipes for the demo model, composed from packs that are already built.

    python benchmarks/demo_recipes.py recipes.json [--tokens 2048] [--window 512] [--answers]

recipes.json maps a recipe's name to its rules, `[[regex over expert keys, pack directory], ...]`, first
match wins, unmatched experts stay bf16; `[]` is the reference itself. A pack directory is a finished
`xmoe quantize` output, or one whose run was stopped (its `.xmoe-partial/parts`). The matching EXL3 tensors
are decoded into the demo's reference model, as `xmoe eval quality` does, and scored on the same windows
of /usr/share/common-licenses/GPL-3. An expert tensor's encoding depends only on its key, K, the encoder and
the seed, so a composed recipe scores exactly what a pack built with that recipe would.

One JSON line per recipe, then a table: the number of EXL3 expert tensors (of 360) and their mean K, KL(reference ||
recipe) mean / median / p99, perplexity in windows and over the first 1,024 tokens in one window
(benchmarks/demo_quality.py's figure), top-1 agreement; with --answers, the greedy 32-token answers to the
demo prompts.
"""
import argparse
import json
import re
import sys
from pathlib import Path

import torch
from demo_quality import TEXT, answers, chat_prompts, perplexity

from xmoe.bench.quality import compare, logprobs, pack_layers, restore, swap
from xmoe.format import load_layer
from xmoe.format.trellis import bits_from_trellis
from xmoe.serve.demo import demo_reference


def exl3_sources(pack: Path) -> dict[str, tuple[Path, int | None]]:
    """{module key: (file, layer)} of a finished pack or of a stopped run's per-tensor parts."""
    parts = pack / ".xmoe-partial" / "parts"
    if not parts.is_dir():
        return pack_layers(pack)
    return {f.name.removesuffix(".safetensors"): (f, int(f.name.split(".")[2])) for f in parts.glob("*.safetensors")}


def compose(rules: list[list[str]], cache: dict) -> tuple[dict, dict]:
    layers, bits = {}, {}
    for pattern, pack in rules:
        src = cache.setdefault(pack, exl3_sources(Path(pack)))
        for key, where in src.items():
            if key not in layers and re.search(pattern, key):
                layers[key] = where
                bits[key] = bits_from_trellis(load_layer(where[0], key)["trellis"])
    return layers, bits


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipes", type=Path)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--answers", action="store_true")
    args = p.parse_args()
    recipes = json.loads(args.recipes.read_text())
    ref_dir = demo_reference()
    tok = AutoTokenizer.from_pretrained(ref_dir)
    ids = tok(TEXT.read_text(), return_tensors="pt").input_ids[0]
    windows = ids[: args.tokens // args.window * args.window].reshape(-1, args.window)
    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    ref = logprobs(model, windows, "reference")
    prompts = chat_prompts(tok)
    cache, rows = {}, []
    for name, rules in recipes.items():
        layers, bits = compose(rules, cache)
        saved = swap(model, layers, list(layers))
        s = compare(ref, logprobs(model, windows, name), windows)
        ppl_1024 = perplexity(model, ids[:1024])
        said = [tok.decode(a, skip_special_tokens=True) for a in answers(model, prompts)] if args.answers else []
        restore(model, saved)
        mean_k = sum(bits.values()) / len(bits) if bits else None  # over the EXL3 tensors only
        rows.append({"recipe": name, "exl3_tensors": len(bits), "mean_K": mean_k, "ppl_1024": ppl_1024,
                     **{k: v for k, v in s.items() if k != "kl_per_token"}, "answers": said})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'recipe':<48} {'EXL3':>5} {'mean K':>6} {'KL mean':>8} {'median':>7} {'p99':>6} {'ppl':>7} "
          f"{'ppl 1024':>8} {'top-1':>6}")
    for r in rows:
        k = "" if r["mean_K"] is None else f"{r['mean_K']:.2f}"
        print(f"{r['recipe'][:48]:<48} {r['exl3_tensors']:>5} {k:>6} {r['kl_mean']:>8.3f} {r['kl_median']:>7.3f} "
              f"{r['kl_p99']:>6.2f} {r['ppl']:>7.2f} {r['ppl_1024']:>8.2f} {r['top1_agreement']:>6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
