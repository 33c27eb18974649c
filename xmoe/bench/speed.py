"""`xmoe bench speed`: decode and prefill speed of a server, for 1 and N concurrent streams.

Decode: the same prompt (its prefix cache warmed first) answered with `short` and with `long` tokens, non-
streaming; decode tokens/s = (long - short) / (time_long - time_short), so prefill, scheduling and HTTP
overheads cancel. With c concurrent streams, c distinct warmed prompts are sent at once and the times are the
wall clock of the whole batch; aggregate = c x per-stream rate. Exact lengths are forced with vLLM's sampling
extras `min_tokens` and `ignore_eos`; a server that rejects them is asked again without them and the lengths
it reports in `usage` are used (flagged `forced: false`; replies that stop early make the figure noisier).
Prefill: c prompts of L tokens at once, each behind a random prefix (so the prefix cache cannot help), one
token generated; prefill tokens/s = all prompt tokens / wall time."""
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tqdm import tqdm

from .client import Client, RequestError
from .texts import chars_per_token, long_text


@dataclass(frozen=True)
class SpeedOptions:
    long: int = 400
    short: int = 16
    prompt_tokens: int = 256                  # prompt of the decode measurement
    prefill: tuple[int, ...] = (2048,)        # prompt lengths for prefill throughput
    concurrency: tuple[int, ...] = (1, 4)
    repeats: int = 3                          # the median is reported
    text: str | None = None
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.short < self.long:
            raise ValueError(f"need 0 < --short < --long, got {self.short} and {self.long}")


def messages(body: str) -> list[dict]:
    return [{"role": "user", "content": f"{body}\n\nContinue this text."}]


class Prompts:
    """Prompts of a requested token length cut from the long text; each with its own random opening words."""

    def __init__(self, client: Client, opts: SpeedOptions):
        self.text, self.source = long_text(opts.text, quiet=True)
        self.cpt, self.overhead = chars_per_token(client, self.text, messages)
        self.rng = random.Random(opts.seed)

    def make(self, tokens: int) -> list[dict]:
        tag = " ".join(str(self.rng.randrange(10 ** 6)) for _ in range(4))
        n = int(max(tokens - self.overhead - 12, 1) * self.cpt)
        start = self.rng.randrange(len(self.text))
        body = (self.text * (2 + n // len(self.text)))[start: start + n]
        return messages(f"[{tag}]\n{body}")


class Forcing:
    """Sends max_tokens with min_tokens/ignore_eos while the server accepts them; remembers when it does not."""

    def __init__(self):
        self.forced = True

    def call(self, client: Client, msgs: list[dict], n: int) -> tuple[float, dict]:
        extra = {"min_tokens": n, "ignore_eos": True} if self.forced else {}
        t0 = time.perf_counter()
        try:
            r = client.chat(msgs, n, **extra)
        except RequestError as e:
            if not extra or "HTTP 4" not in str(e):
                raise
            t0 = time.perf_counter()
            r = client.chat(msgs, n)        # raises when the extras were not what the server refused
            self.forced = False
        return time.perf_counter() - t0, r["usage"]


def batch(client: Client, force: Forcing, prompts: list[list[dict]], n: int) -> tuple[float, list[dict]]:
    """Send all prompts at once; (wall seconds until the last reply, usages)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        usages = [u for _, u in pool.map(lambda m: force.call(client, m, n), prompts)]
    return time.perf_counter() - t0, usages


def decode(client: Client, force: Forcing, prompts: list[list[dict]], opts: SpeedOptions) -> dict:
    batch(client, force, prompts, 1)                          # warm the prefix cache
    short, long = [], []
    for _ in range(opts.repeats):
        short.append(batch(client, force, prompts, opts.short))
        long.append(batch(client, force, prompts, opts.long))
    t_s, t_l = statistics.median(t for t, _ in short), statistics.median(t for t, _ in long)
    n_s = statistics.mean(u["completion_tokens"] for _, us in short for u in us)
    n_l = statistics.mean(u["completion_tokens"] for _, us in long for u in us)
    per_stream = (n_l - n_s) / (t_l - t_s) if t_l > t_s and n_l > n_s else None
    c = len(prompts)
    return {"streams": c, "short_tokens": n_s, "long_tokens": n_l, "short_s": t_s, "long_s": t_l,
            "stream_tok_s": per_stream, "aggregate_tok_s": per_stream and per_stream * c, "forced": force.forced}


def prefill(client: Client, force: Forcing, prompts: Prompts, length: int, streams: int, repeats: int) -> dict:
    """`streams` fresh prompts of `length` tokens sent at once, one token generated; aggregate prompt tokens/s."""
    runs = [batch(client, force, [prompts.make(length) for _ in range(streams)], 1) for _ in range(repeats)]
    t = statistics.median(t for t, _ in runs)
    total = statistics.median(sum(u["prompt_tokens"] for u in us) for _, us in runs)
    return {"target_tokens": length, "streams": streams, "prompt_tokens": total / streams, "seconds": t,
            "prefill_tok_s": total / t}


def run(client: Client, opts: SpeedOptions) -> dict:
    prompts, force = Prompts(client, opts), Forcing()
    steps = len(opts.concurrency) * (1 + len(opts.prefill))
    result = {"model": client.model, "text": prompts.source, "decode": [], "prefill": []}
    with tqdm(total=steps, desc="speed", unit="step", file=sys.stderr) as bar:
        for c in opts.concurrency:
            result["decode"].append(decode(client, force, [prompts.make(opts.prompt_tokens) for _ in range(c)], opts))
            bar.update()
        for length in opts.prefill:
            for c in opts.concurrency:
                result["prefill"].append(prefill(client, force, prompts, length, c, opts.repeats))
                bar.update()
    result["forced"] = force.forced
    return result


def plot(result: dict, path: str) -> None:
    """Aggregate decode tokens/s against streams, and prefill tokens/s against prompt length, as a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise OSError("the plot needs matplotlib: pip install 'xmoe[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    d = [r for r in result["decode"] if r["aggregate_tok_s"]]
    a.plot([r["streams"] for r in d], [r["aggregate_tok_s"] for r in d], "o-", label="aggregate")
    a.plot([r["streams"] for r in d], [r["stream_tok_s"] for r in d], "s--", label="per stream")
    a.set(xlabel="concurrent streams", ylabel="decode tokens/s", title=result["model"], ylim=(0, None))
    a.legend()
    for c in sorted({r["streams"] for r in result["prefill"]}):
        p = [r for r in result["prefill"] if r["streams"] == c]
        b.plot([r["prompt_tokens"] for r in p], [r["prefill_tok_s"] for r in p], "o-", label=f"{c} streams")
    b.set(xlabel="prompt tokens per stream", ylabel="prefill tokens/s (aggregate)", xscale="log", ylim=(0, None))
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
