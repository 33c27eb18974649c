"""Counters from a Prometheus text page (vLLM's /metrics), summed over label sets, and their change over a run."""
import re

# vLLM v1 counter names (counters are exported with the _total suffix).
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"     # prompt tokens looked up in the prefix cache
PREFIX_HITS = "vllm:prefix_cache_hits_total"           # of those, tokens found there
PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
COUNTERS = (PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS, PROMPT_TOKENS, GENERATION_TOKENS)

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse(page: str) -> dict[str, float]:
    """{metric name: value summed over its label sets} for every sample line of the page."""
    out: dict[str, float] = {}
    for line in page.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Change of each known counter; None where the server does not export it."""
    return {k: after[k] - before.get(k, 0.0) if k in after else None for k in COUNTERS}


def prefix_hit_share(d: dict[str, float | None]) -> float | None:
    q, h = d.get(PREFIX_QUERIES), d.get(PREFIX_HITS)
    return h / q if q and h is not None else None
