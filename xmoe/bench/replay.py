"""`xmoe bench replay`: a sustained multi-turn agentic workload for a fixed time. Each of S concurrent sessions
starts from the same long system prompt (tool documentation: the shared prefix), then loops: an assistant
turn streamed back, a long "tool output" appended, the next request carrying the whole history, so prompts
grow turn by turn and every request repeats its predecessor as a prefix. A session that reaches
`max_context` tokens starts over. Reports requests, prompt tokens, the prefix-cache hit share and preemptions
(from the server's /metrics where it exports vLLM's counters), decode tokens/s per stream and in aggregate,
and errors. Tool outputs are sent as user messages so that any chat template accepts them."""
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, replace

from tqdm import tqdm

from . import metrics
from .client import Client, RequestError
from .texts import long_text

SYSTEM = ("You are a coding agent. You call tools by writing one line 'CALL name(args)'. Tools:\n{docs}\n"
          "Keep replies short.")
TASK = "Session {s}: read the files one by one and summarise what each one says in one sentence."


@dataclass(frozen=True)
class ReplayOptions:
    duration: float = 3600.0    # seconds
    sessions: int = 8
    max_tokens: int = 128       # per assistant turn
    tool_chars: int = 4000      # characters of each tool output
    system_chars: int = 8000    # characters of tool documentation in the shared system prompt
    max_context: int = 16384    # prompt tokens at which a session starts over
    text: str | None = None
    seed: int = 0

    def __post_init__(self):
        if self.duration <= 0 or self.sessions < 1 or self.max_tokens < 1:
            raise ValueError(f"replay: need --duration > 0, --sessions >= 1 and --max-tokens >= 1, got "
                             f"{self.duration}, {self.sessions}, {self.max_tokens}")


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = self.errors = self.prompt_tokens = self.completion_tokens = self.restarts = 0
        self.rates: list[float] = []
        self.error_kinds: dict[str, int] = {}

    def add(self, r=None, error: str | None = None):
        with self.lock:
            if error:
                self.errors += 1
                kind = error.split(": ", 1)[-1][:200]
                self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
                return
            self.requests += 1
            self.prompt_tokens += r.prompt_tokens or 0
            self.completion_tokens += r.completion_tokens
            if r.decode_tok_s:
                self.rates.append(r.decode_tok_s)


def session(client: Client, s: int, text: str, opts: ReplayOptions, tally: Tally, stop: float, bar):
    rng = random.Random(opts.seed * 1000 + s)
    system = SYSTEM.format(docs=text[: opts.system_chars])
    history = [{"role": "system", "content": system}, {"role": "user", "content": TASK.format(s=s)}]
    while time.perf_counter() < stop:
        try:
            r = client.stream_chat(history, opts.max_tokens)
        except RequestError as e:       # e.g. a context the server refuses: count it, start the session over
            tally.add(error=str(e))
            history = history[:2]
            time.sleep(0.5)
            continue
        tally.add(r)
        bar.update()
        if (r.prompt_tokens or 0) + opts.tool_chars // 2 > opts.max_context:
            history = history[:2]
            with tally.lock:
                tally.restarts += 1
            continue
        start = rng.randrange(len(text) - opts.tool_chars)
        history += [{"role": "assistant", "content": r.text or "CALL read_file()"},
                    {"role": "user", "content": f"Tool output:\n{text[start: start + opts.tool_chars]}"}]


def scrape(client: Client) -> dict[str, float] | None:
    try:
        return metrics.parse(client.metrics())
    except RequestError as e:
        print(f"note: no server metrics ({e}); prefix-cache share and preemptions not reported", file=sys.stderr)
        return None


def fit_context(opts: ReplayOptions, server: int | None) -> tuple[ReplayOptions, list[str]]:
    """Sessions restart before their prompt and the next two replies (the one just added to the history and
    the one asked for) outgrow the server's context."""
    room = server - 2 * opts.max_tokens if server else None
    if room is None or opts.max_context <= room:
        return opts, []
    if room < 64:
        raise ValueError(f"replay: the server's context of {server} tokens leaves no room for a session beside "
                         f"{opts.max_tokens}-token replies")
    return replace(opts, max_context=room), [f"sessions restart at {room} prompt tokens, not {opts.max_context}: "
                                             f"the server's context is {server} tokens"]


def run(client: Client, opts: ReplayOptions) -> dict:
    text, source = long_text(opts.text, quiet=True)
    opts, notes = fit_context(opts, client.context_length())
    before = scrape(client)
    tally = Tally()
    t0 = time.perf_counter()
    stop = t0 + opts.duration
    with tqdm(desc=f"replay {opts.sessions} sessions, {opts.duration:g} s", unit="req", file=sys.stderr) as bar:
        threads = [threading.Thread(target=session, args=(client, s, text, opts, tally, stop, bar), daemon=True)
                   for s in range(opts.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - t0
    after = scrape(client) if before is not None else None
    d = metrics.delta(before, after) if after is not None else {}
    return {"model": client.model, "sessions": opts.sessions, "seconds": wall, "requests": tally.requests,
            "errors": tally.errors, "error_kinds": tally.error_kinds, "restarts": tally.restarts,
            "prompt_tokens": tally.prompt_tokens, "completion_tokens": tally.completion_tokens,
            "aggregate_tok_s": tally.completion_tokens / wall,
            "stream_tok_s_median": statistics.median(tally.rates) if tally.rates else None,
            "prefix_hit_share": metrics.prefix_hit_share(d) if d else None,
            "preemptions": d.get(metrics.PREEMPTIONS), "server_counters": d, "text": source,
            "max_context": opts.max_context, "notes": notes}
