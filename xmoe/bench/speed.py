"""`xmoe bench speed`: decode and prefill speed of a server, for 1 and N concurrent streams.

Decode: the same prompt (its prefix cache warmed first) answered with `short` and with `long` tokens, non-
streaming (`long` by default sized to some seconds of decoding at the speed one stream gets, up to 400);
decode tokens/s = (long - short) / (time_long - time_short), so prefill, scheduling and HTTP overheads cancel.
With c concurrent streams, c distinct warmed prompts are sent at once and the times are the wall clock of the
whole batch; aggregate = c x per-stream rate. Exact lengths are forced with vLLM's sampling
extras `min_tokens` and `ignore_eos`; on a server that rejects them (asked once) the lengths it reports in
`usage` are used (flagged `forced: false`; replies that stop early make the figure noisier).
Prefill: c prompts of L tokens at once, each behind a random prefix (so the prefix cache cannot help), one
token generated; prefill tokens/s = all prompt tokens / wall time.
Each step reports the median of `repeats` runs, fewer where one run alone takes long (its noise is then small).
Prompt lengths are the server's own token counts, and are fitted to the context length it states."""
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tqdm import tqdm

from .client import Client, RequestError
from .fit import Counter, chars_per_token, fit
from .report import Reasons
from .texts import long_text

MIN_PROMPT = 64         # decode prompts shorter than this say little about a server's speed
LONG_SECONDS = 8.0      # the default long reply: enough time that HTTP and scheduling jitter do not matter
LONG_RANGE = (64, 400)
STEP_SECONDS = 20.0     # a step stops repeating once it has run this long


@dataclass(frozen=True)
class SpeedOptions:
    long: int | None = None                   # None: LONG_SECONDS of decoding at the measured speed
    short: int = 16
    prompt_tokens: int = 256                  # prompt of the decode measurement
    prefill: tuple[int, ...] = (2048,)        # prompt lengths for prefill throughput
    concurrency: tuple[int, ...] = (1, 4)
    repeats: int = 3                          # the median is reported
    text: str | None = None
    seed: int = 0

    def __post_init__(self):
        if self.short < 1 or self.long is not None and self.long <= self.short:
            raise ValueError(f"need 0 < --short < --long, got {self.short} and {self.long}")


@dataclass(frozen=True)
class Plan:
    prompt_tokens: int | None       # of the decode measurement; None: it cannot fit the context
    prefill: tuple[int, ...]
    notes: tuple[str, ...]          # what was changed to fit, and why


def plan(opts: SpeedOptions, context: int | None, long: int) -> Plan:
    """The lengths to measure, fitted to the server's context (prompt and reply together): the decode prompt
    shortened so that the long reply still fits, prefill prompts cut to the longest the context takes with
    their one reply token."""
    if context is None:
        return Plan(opts.prompt_tokens, opts.prefill, ("the server does not state its context length: lengths as "
                                                       "asked",))
    notes = []
    prompt = min(opts.prompt_tokens, context - long)
    if prompt < MIN_PROMPT:
        prompt = None
        notes.append(f"decode not measured: --long {long} leaves fewer than {MIN_PROMPT} prompt tokens in the "
                     f"server's {context}-token context")
    elif prompt < opts.prompt_tokens:
        notes.append(f"decode prompt {opts.prompt_tokens} -> {prompt} tokens, so that it and the {long}-token "
                     f"reply fit the server's {context}-token context")
    longest = context - 1
    over = [n for n in opts.prefill if n > longest]
    if over:
        notes.append(f"prefill {', '.join(map(str, over))} -> {longest} tokens: the longest prompt the server's "
                     f"{context}-token context takes with a one-token reply")
    return Plan(prompt, tuple(dict.fromkeys(min(n, longest) for n in opts.prefill)), tuple(notes))


def messages(body: str) -> list[dict]:
    return [{"role": "user", "content": f"{body}\n\nContinue this text."}]


class Prompts:
    """Prompts of a requested token length cut from the long text, each opening with its own random number
    (so that no two share a cached prefix). The cut is fitted once per length, with the server's count."""

    def __init__(self, client: Client, opts: SpeedOptions):
        self.text, self.source = long_text(opts.text, quiet=True)
        self.count = Counter(client)
        self.cpt = chars_per_token(self.count, self.text, messages)
        self.rng = random.Random(opts.seed)
        self.cuts: dict[int, str] = {}

    def _tagged(self, tag: int, body: str) -> list[dict]:
        return messages(f"[{tag:012d}]\n{body}")     # fixed width: every tag is the same number of tokens

    def make(self, tokens: int) -> list[dict]:
        if tokens not in self.cuts:
            start = self.rng.randrange(len(self.text))
            body = lambda n: (self.text * (2 + n // len(self.text)))[start: start + n]
            self.cuts[tokens] = body(fit(lambda n: self._tagged(0, body(n)), tokens, self.count, self.cpt).chars)
        return self._tagged(self.rng.randrange(10 ** 12), self.cuts[tokens])


class Forcing:
    """Whether the server takes vLLM's `min_tokens`/`ignore_eos` (asked once, with a two-token request); then
    every measurement is sent with them, or without them all."""

    def __init__(self, client: Client):
        try:
            client.chat(messages("Hello."), 2, min_tokens=2, ignore_eos=True)
            self.forced = True
        except RequestError as e:
            if e.status not in (400, 422):
                raise
            self.forced = False

    def extra(self, n: int) -> dict:
        return {"min_tokens": n, "ignore_eos": True} if self.forced else {}

    def call(self, client: Client, msgs: list[dict], n: int) -> tuple[float, dict]:
        t0 = time.perf_counter()
        r = client.chat(msgs, n, **self.extra(n))
        return time.perf_counter() - t0, r["usage"]


def long_length(client: Client, force: Forcing, opts: SpeedOptions) -> tuple[int, list[str]]:
    """(`long`, notes): as asked, else LONG_SECONDS at the decode speed of one streamed reply, within LONG_RANGE."""
    if opts.long is not None:
        return opts.long, []
    rate = client.stream_chat(messages("Hello."), 32, **force.extra(32)).decode_tok_s
    lo, hi = max(LONG_RANGE[0], 4 * opts.short), LONG_RANGE[1]
    if not rate:
        return hi, []
    long = min(max(round(rate * LONG_SECONDS), lo), hi)
    return long, [] if long == hi else [f"long replies of {long} tokens: {LONG_SECONDS:g} s at the {rate:.3g} tok/s "
                                        f"one stream decodes (--long sets it)"]


def repeated(measure, repeats: int) -> list:
    """`measure()` `repeats` times, or fewer once STEP_SECONDS have passed."""
    t0, runs = time.monotonic(), []
    while len(runs) < repeats and (not runs or time.monotonic() - t0 < STEP_SECONDS):
        runs.append(measure())
    return runs


def batch(client: Client, force: Forcing, prompts: list[list[dict]], n: int) -> tuple[float, list[dict]]:
    """Send all prompts at once; (wall seconds until the last reply, usages)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        usages = [u for _, u in pool.map(lambda m: force.call(client, m, n), prompts)]
    return time.perf_counter() - t0, usages


def decode(client: Client, force: Forcing, prompts: list[list[dict]], opts: SpeedOptions, n_long: int) -> dict:
    # warm-up, not timed: the prompts' prefix cache, and kernels a server compiles at first use of a batch size
    batch(client, force, prompts, opts.short)
    runs = repeated(lambda: (batch(client, force, prompts, opts.short), batch(client, force, prompts, n_long)),
                    opts.repeats)
    short, long = [s for s, _ in runs], [l for _, l in runs]
    t_s, t_l = statistics.median(t for t, _ in short), statistics.median(t for t, _ in long)
    n_s = statistics.mean(u["completion_tokens"] for _, us in short for u in us)
    n_l = statistics.mean(u["completion_tokens"] for _, us in long for u in us)
    per_stream = (n_l - n_s) / (t_l - t_s) if t_l > t_s and n_l > n_s else None
    c = len(prompts)
    return {"streams": c, "prompt_tokens": statistics.mean(u["prompt_tokens"] for _, us in long for u in us),
            "short_tokens": n_s, "long_tokens": n_l, "short_s": t_s, "long_s": t_l, "stream_tok_s": per_stream,
            "aggregate_tok_s": per_stream and per_stream * c, "forced": force.forced, "repeats": len(runs),
            "error": None}


def prefill(client: Client, force: Forcing, prompts: Prompts, length: int, streams: int, repeats: int) -> dict:
    """`streams` fresh prompts of `length` tokens sent at once, one token generated; aggregate prompt tokens/s."""
    def fresh() -> list[list[dict]]:
        return [prompts.make(length) for _ in range(streams)]

    batch(client, force, fresh(), 1)  # warm-up, not timed: kernels compiled at first use of this length
    runs = repeated(lambda: batch(client, force, fresh(), 1), repeats)
    t = statistics.median(t for t, _ in runs)
    total = statistics.median(sum(u["prompt_tokens"] for u in us) for _, us in runs)
    return {"target_tokens": length, "streams": streams, "prompt_tokens": total / streams, "seconds": t,
            "prefill_tok_s": total / t, "repeats": len(runs), "error": None}


def run(client: Client, opts: SpeedOptions) -> dict:
    """Every step of the sweep; one that fails keeps its row, with the server's reason, and the sweep goes on."""
    context = client.context_length()
    prompts, force = Prompts(client, opts), Forcing(client)
    n_long, notes = long_length(client, force, opts)
    p = plan(opts, context, n_long)
    steps = [("decode", {"streams": c}) for c in opts.concurrency if p.prompt_tokens]
    steps += [("prefill", {"target_tokens": n, "streams": c}) for n in p.prefill for c in opts.concurrency]
    result = {"model": client.model, "text": prompts.source, "context": context, "counted_by": prompts.count.method,
              "long": n_long, "notes": [*notes, *p.notes], "decode": [], "prefill": []}
    with tqdm(total=len(steps), desc="speed", unit="step", file=sys.stderr) as bar:
        for kind, row in steps:
            try:
                if kind == "decode":
                    msgs = [prompts.make(p.prompt_tokens) for _ in range(row["streams"])]
                    row = decode(client, force, msgs, opts, n_long)
                else:
                    row = prefill(client, force, prompts, row["target_tokens"], row["streams"], opts.repeats)
            except (RequestError, ValueError) as e:
                row = {**row, "error": str(e)}
            except KeyboardInterrupt:
                result["notes"].append("interrupted: the steps measured before it are shown")
                break
            result[kind].append(row)
            bar.update()
    result["forced"] = force.forced
    return result


def tables(result: dict) -> tuple[list[dict], list[dict], list[str]]:
    """(decode rows, prefill rows, notes) for the printout; a failed step's row names its reason."""
    why = Reasons()
    failed = lambda r: {"failed": why.refs([r["error"]])} if r["error"] else {}
    decode = [{"streams": d["streams"], "prompt tokens": d.get("prompt_tokens"),
               "decode tok/s per stream": d.get("stream_tok_s"), "aggregate tok/s": d.get("aggregate_tok_s"),
               **({} if d["error"] else {"tokens short/long": f"{d['short_tokens']:g}/{d['long_tokens']:g}",
                                         "seconds short/long": f"{d['short_s']:.2f}/{d['long_s']:.2f}"}),
               **failed(d)} for d in result["decode"]]
    prefill = [{"streams": p["streams"], "prompt tokens asked": p["target_tokens"],
                "prompt tokens per stream": p.get("prompt_tokens"), "seconds": p.get("seconds"),
                "prefill tok/s (aggregate)": p.get("prefill_tok_s"), **failed(p)} for p in result["prefill"]]
    return decode, prefill, [*result["notes"], *why.lines()]


def plot(result: dict, path: str) -> None:
    """Aggregate decode tokens/s against streams, and prefill tokens/s against prompt length, as a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise OSError("the plot needs matplotlib: pip install 'xmoe[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    d = [r for r in result["decode"] if r.get("aggregate_tok_s")]
    a.plot([r["streams"] for r in d], [r["aggregate_tok_s"] for r in d], "o-", label="aggregate")
    a.plot([r["streams"] for r in d], [r["stream_tok_s"] for r in d], "s--", label="per stream")
    a.set(xlabel="concurrent streams", ylabel="decode tokens/s", title=result["model"], ylim=(0, None))
    a.legend()
    for c in sorted({r["streams"] for r in result["prefill"]}):
        p = [r for r in result["prefill"] if r["streams"] == c and not r["error"]]
        b.plot([r["prompt_tokens"] for r in p], [r["prefill_tok_s"] for r in p], "o-", label=f"{c} streams")
    b.set(xlabel="prompt tokens per stream", ylabel="prefill tokens/s (aggregate)", xscale="log", ylim=(0, None))
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
