"""`xmoe eval quality URL --reference URL`: the quality eval through two running servers (the pack and its
source), for models too large to load beside each other in one process. Each server scores the same text with
vLLM's `prompt_logprobs` (the log-probability of every prompt token, plus the top-k alternatives).

Perplexity is exact. The KL is a lower bound: both distributions are coarse-grained to the tokens both
servers listed at that position (each one's top-k, and the true token) plus one "everything else" bucket,
which is a partition of the vocabulary, and coarse-graining never raises a KL. `kl_coverage` is the mean
share of the reference's probability inside the common tokens: near 1 means the bound is tight. k is limited
by the servers' `--max-logprobs` (vLLM: 20 by default)."""
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .client import Client


@dataclass(frozen=True)
class ServedQualityOptions:
    text: str
    tokens: int = 2048          # stop once this many tokens are scored
    chunk_chars: int = 2000     # characters per request (each chunk is scored from its second token on)
    top_k: int = 20


def score_chunk(client: Client, text: str, k: int) -> tuple[list[int], list[dict[int, float]]]:
    """(prompt token ids, {token id: logprob} per position after the first). Each dict holds the top-k and
    the prompt token itself; key -1 holds the k-th best logprob (every unlisted token is below it)."""
    r = client.complete(text, 1, prompt_logprobs=k, return_token_ids=True)["choices"][0]
    ids, lps = r.get("prompt_token_ids"), r.get("prompt_logprobs")
    if not ids or not lps:
        raise ValueError(f"{client.base}: no prompt_logprobs/prompt_token_ids in the reply (a vLLM server is "
                         f"needed for this route)")
    out = []
    for pos in lps[1:]:
        listed = {int(t): v["logprob"] for t, v in pos.items()}
        listed[-1] = min(v["logprob"] for v in pos.values() if v.get("rank", 1) <= k)
        out.append(listed)
    return ids, out


def position_kl(ref: dict[int, float], got: dict[int, float]) -> tuple[float, float]:
    """(KL(ref || got) coarse-grained to the tokens both list plus the rest, ref's probability in those)."""
    common = [t for t in ref if t != -1 and t in got]
    p = [math.exp(ref[t]) for t in common]
    q = [math.exp(got[t]) for t in common]
    kl = sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q) if a > 0)
    p_rest, q_rest = max(1 - sum(p), 0.0), max(1 - sum(q), 1e-12)
    if p_rest > 0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(kl, 0.0), sum(p)


def top(listed: dict[int, float]) -> int:
    return max((t for t in listed if t != -1), key=listed.get)


def evaluate_served(pack: Client, reference: Client, opts: ServedQualityOptions) -> dict:
    text = Path(opts.text).read_text(errors="replace")
    chunks = [text[i: i + opts.chunk_chars] for i in range(0, len(text), opts.chunk_chars)]
    kls, nll_ref, nll_got, coverage, top1 = [], [], [], 0.0, 0
    with tqdm(total=opts.tokens, desc="scored tokens", unit="tok", file=sys.stderr) as bar:
        for chunk in chunks:
            ids_r, ref = score_chunk(reference, chunk, opts.top_k)
            ids_g, got = score_chunk(pack, chunk, opts.top_k)
            if ids_r != ids_g:
                raise ValueError(f"{reference.base} and {pack.base} tokenize the text differently; "
                                 f"the two models must share a tokenizer")
            for target, r, g in zip(ids_r[1:], ref, got):
                kl, covered = position_kl(r, g)
                kls.append(kl)
                coverage += covered
                nll_ref.append(-r[target])
                nll_got.append(-g[target])
                top1 += top(r) == top(g)
            bar.update(len(ref))
            if len(kls) >= opts.tokens:
                break
    if not kls:
        raise ValueError(f"{opts.text}: no tokens to score")
    kls_sorted = sorted(kls)
    return {"pack": pack.base, "reference": reference.base, "text": opts.text, "tokens_scored": len(kls),
            "top_k": opts.top_k, "kl_mean": statistics.fmean(kls), "kl_median": statistics.median(kls),
            "kl_p99": kls_sorted[min(len(kls) - 1, int(0.99 * len(kls)))], "kl_max": kls_sorted[-1],
            "kl_coverage": coverage / len(kls), "ppl_reference": math.exp(statistics.fmean(nll_ref)),
            "ppl": math.exp(statistics.fmean(nll_got)), "top1_agreement": top1 / len(kls), "kl_per_token": kls,
            "groups": [], "exl3_modules": None}
