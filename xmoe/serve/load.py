"""A bounded-time load run against an OpenAI-compatible server: N concurrent streaming chat clients, each
sending its next request as soon as the previous one ends, until the time is up. Counts every error."""
import asyncio
import time
from dataclasses import dataclass, field

PROMPTS = ("What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
           "Explain what a CPU does in one sentence.", "Give me a synonym for happy.",
           "What is 12 plus 30?", "List two uses of water.", "Why is the sky blue?")


@dataclass(frozen=True)
class LoadOptions:
    clients: int = 32
    seconds: float = 60.0  # new requests start until then; the ones in flight finish
    max_tokens: int = 48
    request_timeout: float = 300.0

    def __post_init__(self):
        if self.clients < 1 or self.seconds <= 0 or self.max_tokens < 1:
            raise ValueError(f"load options must be positive: {self}")


@dataclass
class LoadReport:
    clients: int
    seconds: float = 0.0  # wall time from the first request to the last answer
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    empty: int = 0  # answers finished with no text (the model's first token ended it): valid, counted apart
    output_tokens: int = 0
    prompt_tokens: int = 0
    latencies: list[float] = field(default_factory=list)  # per request, seconds
    ttfts: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        return {"clients": self.clients, "seconds": round(self.seconds, 1), "requests": self.requests,
                "errors": len(self.errors), "empty": self.empty, "output_tokens": self.output_tokens,
                "output_tok_per_s": round(self.output_tokens / self.seconds, 1) if self.seconds else 0.0,
                "latency_p50_s": _pct(self.latencies, 50), "latency_p95_s": _pct(self.latencies, 95),
                "ttft_p50_s": _pct(self.ttfts, 50), "ttft_p95_s": _pct(self.ttfts, 95)}


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))], 3)


async def _one(client, model: str, prompt: str, opts: LoadOptions, report: LoadReport) -> None:
    t0, first, usage, text, finish = time.perf_counter(), None, None, "", None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=opts.max_tokens,
        temperature=0.7, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    # a stream cut short lacks its finish reason or usage; one that ends at once (say, end-of-text sampled first)
    # is a valid answer with no text
    if usage is None or finish is None:
        raise RuntimeError(f"stream ended without {'usage' if usage is None else 'a finish reason'}")
    if not text:
        if not (finish == "stop" and usage.completion_tokens <= 1):
            raise RuntimeError(f"no text in {usage.completion_tokens} tokens (finish reason {finish})")
        report.empty += 1
    report.requests += 1
    report.output_tokens += usage.completion_tokens
    report.prompt_tokens += usage.prompt_tokens
    report.latencies.append(time.perf_counter() - t0)
    if first is not None:
        report.ttfts.append(first - t0)


async def _client(i: int, client, model: str, opts: LoadOptions, deadline: float, report: LoadReport) -> None:
    n = 0
    while time.perf_counter() < deadline:
        try:
            await _one(client, model, PROMPTS[(i + n) % len(PROMPTS)], opts, report)
        except Exception as e:  # every failure is counted and reported, none stops the run
            report.errors.append(f"client {i}: {type(e).__name__}: {e}")
        n += 1


async def _run(base_url: str, api_key: str | None, model: str, opts: LoadOptions) -> LoadReport:
    import httpx
    from openai import AsyncOpenAI
    limits = httpx.Limits(max_connections=opts.clients, max_keepalive_connections=opts.clients)
    async with AsyncOpenAI(base_url=base_url, api_key=api_key or "none", max_retries=0,
                           timeout=opts.request_timeout,
                           http_client=httpx.AsyncClient(limits=limits, timeout=opts.request_timeout)) as client:
        report = LoadReport(opts.clients)
        t0 = time.perf_counter()
        await asyncio.gather(*(_client(i, client, model, opts, t0 + opts.seconds, report)
                               for i in range(opts.clients)))
        report.seconds = time.perf_counter() - t0
    return report


def run_load(base_url: str, api_key: str | None, model: str, opts: LoadOptions = LoadOptions()) -> LoadReport:
    """`base_url` ends in /v1. Returns the report; errors are in report.errors, not raised."""
    return asyncio.run(_run(base_url, api_key, model, opts))
