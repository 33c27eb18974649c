"""How the demo model's answers compare with the unquantized reference (transformers, fp32, on the CPU).

    python benchmarks/demo_quality.py --variants test full

For each variant the EXL3 experts are decoded into the reference model; printed per variant: perplexity on
the first 1,024 tokens of /usr/share/common-licenses/GPL-3, the share of greedy tokens equal to the
reference's (8 chat prompts x 32 tokens, each continued from the reference's own prefix), exact-match answers,
and each answer. --json prints the numbers only.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))
from reference import exl3_tensors, set_decoded  # noqa: E402

from xmoe.bench.cli import QUALITY_TEXT  # noqa: E402
from xmoe.format import decode_weight  # noqa: E402
from xmoe.serve.demo import demo_model, demo_reference  # noqa: E402
from xmoe.serve.load import PROMPTS  # noqa: E402

TEXT = Path(QUALITY_TEXT)
N = 32


def chat_prompts(tok) -> list[list[int]]:
    """The demo prompts (xmoe.serve.load.PROMPTS) as chat-templated token ids."""
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for q in PROMPTS]


def load(variant: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(demo_reference(), dtype=torch.float32).eval()
    if variant != "reference":
        for key, t in exl3_tensors(demo_model(variant)).items():
            set_decoded(model, key.replace(".block_sparse_moe.", ".mlp."), decode_weight(t))
    return model


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    logits = model(ids[None]).logits[0, :-1]
    return float(torch.nn.functional.cross_entropy(logits, ids[1:]).exp())


@torch.no_grad()
def answers(model, prompts: list[list[int]]) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


@torch.no_grad()
def agreement(model, prompts: list[list[int]], ref: list[list[int]]) -> float:
    """Share of positions where the model's argmax equals the reference's next token (teacher-forced)."""
    same = total = 0
    for p, r in zip(prompts, ref):
        logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1]
        same += int((logits.argmax(-1) == torch.tensor(r)).sum())
        total += len(r)
    return same / total


def main() -> int:
    from transformers import AutoTokenizer
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=["test", "full"], choices=["test", "full"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(demo_reference())
    text_ids = torch.tensor(tok(TEXT.read_text())["input_ids"][:1024])
    prompts = chat_prompts(tok)
    ref_model = load("reference")
    ref = answers(ref_model, prompts)
    rows = [{"variant": "reference", "ppl": perplexity(ref_model, text_ids), "token_agreement": 1.0,
             "exact_answers": len(ref), "answers": [tok.decode(a, skip_special_tokens=True) for a in ref]}]
    del ref_model
    for v in args.variants:
        model = load(v)
        got = answers(model, prompts)
        rows.append({"variant": v, "ppl": perplexity(model, text_ids), "token_agreement": agreement(model, prompts, ref),
                     "exact_answers": sum(a == b for a, b in zip(got, ref)),
                     "answers": [tok.decode(a, skip_special_tokens=True) for a in got]})
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "answers"} for r in rows]))
        return 0
    print(f"{'variant':<10} {'ppl GPL-3':>9} {'token agreement':>16} {'exact answers':>14}")
    for r in rows:
        print(f"{r['variant']:<10} {r['ppl']:>9.2f} {r['token_agreement']:>16.3f} {r['exact_answers']:>9}/{len(PROMPTS)}")
    for i, q in enumerate(PROMPTS):
        print(f"\n{q}")
        for r in rows:
            print(f"  {r['variant']:<10} {r['answers'][i]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
