"""`xmoe bench ...` and `xmoe eval quality`: argument parsing and the summary printout, one function per tool."""
import argparse
import os

from . import report

QUALITY_TEXT = "/usr/share/common-licenses/GPL-3"   # on every Debian system: comparable across machines


def _endpoint(args, url: str, model: str | None):
    from .client import Client, Endpoint  # httpx: the bench extra
    return Client(Endpoint(url, args.api_key, model, args.timeout))


def _client(args):
    return _endpoint(args, args.url, args.model)


def _speed(args) -> int:
    from .speed import SpeedOptions, plot, run, tables
    opts = SpeedOptions(args.long, args.short, args.prompt_tokens, tuple(args.prefill), tuple(args.concurrency),
                        args.repeats, args.text)
    result = run(_client(args), opts)
    decode, prefill, notes = tables(result)
    forced = "" if result["forced"] else " (lengths NOT forced: the server refused min_tokens/ignore_eos)"
    context = f", context {result['context']} tokens" if result["context"] else ""
    report.emit(f"decode speed of {result['model']}{context}{forced}", decode, result, args.json,
                more=(("prefill (prefix cache bypassed)", prefill),) if prefill else (), notes=notes)
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    return 0 if any(not r["error"] for r in result["decode"] + result["prefill"]) else 1


def _needle(args) -> int:
    from .needle import NeedleOptions, rows, run
    opts = NeedleOptions(args.context, tuple(args.depths), args.trials, args.max_tokens, args.concurrency, args.text)
    result = run(_client(args), opts)
    table, notes = rows(result)
    failed = len(result["items"]) - result["answered"]
    score = (f"pass rate {result['pass_rate']:.0%} of {result['answered']} answered" if result["answered"]
             else "no request answered")
    report.emit(f"needle in {result['text']} at {result['context']} tokens: {score}"
                f"{f', {failed} failed (reasons below)' if failed else ''}", table, result, args.json, notes=notes)
    return 0 if result["answered"] else 1


def _toolcall(args) -> int:
    from .toolcall import ToolcallOptions, rows, run
    opts = ToolcallOptions(tuple(args.categories), args.n, args.max_tokens, args.concurrency, args.tool_choice,
                           args.time_limit)
    result = run(_client(args), opts)
    table, notes = rows(result)
    report.emit(f"tool calls of {result['model']} (BFCL v4, tool_choice {opts.tool_choice})", table, result,
                args.json, notes=notes)
    return 0


def _gsm8k(args) -> int:
    from .gsm8k import Gsm8kOptions, rows, run
    other = _endpoint(args, args.other_url, args.other_model) if args.other_url else None
    result = run(_client(args), Gsm8kOptions(args.n, args.max_tokens, args.concurrency, args.data, args.time_limit),
                 other)
    table, notes = rows(result)
    report.emit("GSM8K", table, result, args.json, notes=notes)
    return 0


def _humaneval(args) -> int:
    from .humaneval import HumanEvalOptions, run
    from .sandbox import Limits
    limits = Limits(args.timeout_per_problem, args.memory_mb << 20)
    result = run(_client(args), HumanEvalOptions(args.n, args.mode, args.max_tokens, args.concurrency, limits,
                                                 args.time_limit))
    why = report.Reasons()
    statuses = dict(result["statuses"])
    if "request error" in statuses:         # the count, and the server's reasons below the table
        statuses["request error"] = why.cell(i["detail"] if i["status"] == "request error" else None
                                             for i in result["items"])
    rows = [{"model": result["model"], "mode": result["mode"], "n": result["n"], "passed": result["passed"],
             "pass@1": result["pass@1"], **statuses}]
    notes = report.shortfall(result["stopped"], result["n"], result["asked"], "problems", result["time_limit"])
    report.emit("HumanEval", rows, result, args.json, notes=[*notes, *why.lines()])
    return 0


def _replay(args) -> int:
    from .replay import ReplayOptions, run
    opts = ReplayOptions(args.duration, args.sessions, args.max_tokens, args.tool_chars, args.system_chars,
                         args.max_context, args.text)
    result = run(_client(args), opts)
    cols = ["sessions", "seconds", "requests", "errors", "prompt_tokens", "completion_tokens", "prefix_hit_share",
            "preemptions", "stream_tok_s_median", "aggregate_tok_s"]
    why = report.Reasons()
    row = {**result, "errors": why.cell(k for k, n in result["error_kinds"].items() for _ in range(n))}
    report.emit(f"replay against {result['model']}", [row], result, args.json, cols,
                notes=[*result["notes"], *why.lines()])
    return 0


def _quality(args) -> int:
    served = [a.startswith(("http://", "https://")) for a in (args.model, args.reference)]
    if any(served):
        if not all(served):
            raise ValueError("give two URLs (servers) or two model directories, not one of each")
        from .served_quality import ServedQualityOptions, evaluate_served
        opts = ServedQualityOptions(args.text or QUALITY_TEXT, args.tokens, top_k=args.top_k)
        result = evaluate_served(_endpoint(args, args.model, None), _endpoint(args, args.reference, None), opts)
    else:
        from .quality import QualityOptions, evaluate
        opts = QualityOptions(args.text or QUALITY_TEXT, args.tokens, args.window, args.groups, args.dtype,
                              args.device_map)
        result = evaluate(args.model, args.reference, opts)
    from .quality import rows
    note = (f"; KL: a lower bound from the top-{args.top_k} log-probabilities, which hold "
            f"{result['kl_coverage']:.0%} of the reference's probability" if any(served) else "")
    report.emit(f"quality of {args.model} against {args.reference}: {result['tokens_scored']} tokens of "
                f"{opts.text}{note}", rows(result), result, args.json)
    return 0


def _common(p: argparse.ArgumentParser, concurrency: int | None = None):
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("API_KEY"),
                   help="bearer token (default: $API_KEY); one that starts with - is written --api-key=KEY")
    p.add_argument("--model", help="served model name (default: the server's first model)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", metavar="PATH", help="write the full result as JSON ('-': stdout, no table)")
    if concurrency:
        p.add_argument("--concurrency", type=int, default=concurrency, help="requests in flight")


def _time_limit(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--time-limit", type=float, default=300.0, metavar="SECONDS",
                   help=f"start no more {what} after this, so that a slow server (a CPU) still gives a table in "
                        f"minutes; the table says how many were scored (0: no limit; default %(default)g)")


def add_bench(sub) -> None:
    b = sub.add_parser("bench", help="speed, smoke and quality probes against an OpenAI-compatible server")
    tools = b.add_subparsers(dest="tool", required=True)
    _load_parsers(tools)
    _task_parsers(tools)


def _load_parsers(tools) -> None:
    s = tools.add_parser("speed", help="decode and prefill tokens/s, 1 and N streams")
    _common(s)
    s.add_argument("--long", type=int, help="tokens of the long reply (default: about 8 s of decoding at the "
                                             "speed one stream gets, 64 to 400)")
    s.add_argument("--short", type=int, default=16, help="tokens of the short reply")
    s.add_argument("--prompt-tokens", type=int, default=256, help="prompt length of the decode measurement")
    s.add_argument("--prefill", type=int, nargs="*", default=[2048], help="prompt lengths for prefill tok/s")
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 4],
                   help="stream counts to measure (decode and prefill)")
    s.add_argument("--repeats", type=int, default=3,
                   help="runs per step, the median reported (fewer once a step has run 20 s)")
    s.add_argument("--text", help="text file for prompts (default: the KJV or the license texts)")
    s.add_argument("--plot", metavar="PNG", help="plot the sweep (needs matplotlib)")
    s.set_defaults(func=_speed)

    r = tools.add_parser("replay", help="sustained multi-turn agentic load for a fixed time")
    _common(r)
    r.add_argument("--duration", type=float, default=3600.0, help="seconds")
    r.add_argument("--sessions", type=int, default=8)
    r.add_argument("--max-tokens", type=int, default=128, help="per assistant turn")
    r.add_argument("--tool-chars", type=int, default=4000, help="characters per tool output")
    r.add_argument("--system-chars", type=int, default=8000, help="characters of the shared system prompt")
    r.add_argument("--max-context", type=int, default=16384, help="prompt tokens at which a session restarts")
    r.add_argument("--text", help="text file for tool outputs (default: the KJV or the license texts)")
    r.set_defaults(func=_replay)


def _task_parsers(tools) -> None:
    n = tools.add_parser("needle", help="needle-in-a-haystack retrieval at a context length, per depth")
    _common(n, 4)
    n.add_argument("--context", type=int, default=4096, help="prompt tokens")
    n.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    n.add_argument("--trials", type=int, default=2, help="per depth")
    n.add_argument("--max-tokens", type=int, default=24)
    n.add_argument("--text", help="haystack text file (default: the KJV or the license texts)")
    n.set_defaults(func=_needle)

    t = tools.add_parser("toolcall", help="BFCL v4 tool calls: exact function and argument match")
    _common(t, 8)
    t.add_argument("--categories", nargs="+", default=["simple_python", "multiple"])
    t.add_argument("--n", type=int, default=50, help="items per category")
    t.add_argument("--max-tokens", type=int, default=256)
    t.add_argument("--tool-choice", choices=["auto", "required"], default="auto",
                   help="required: the server must constrain the reply to a call (vLLM: guided decoding)")
    _time_limit(t, "items")
    t.set_defaults(func=_toolcall)

    g = tools.add_parser("gsm8k", help="GSM8K accuracy, and agreement with a second endpoint")
    _common(g, 8)
    g.add_argument("--n", type=int, default=200)
    g.add_argument("--max-tokens", type=int, default=512)
    g.add_argument("--data", help="GSM8K test.jsonl (default: cached copy, fetched once from GitHub)")
    g.add_argument("--other-url", help="second endpoint to compare answers with (e.g. the unquantized model)")
    g.add_argument("--other-model", help="model name at --other-url (default: its first)")
    _time_limit(g, "problems")
    g.set_defaults(func=_gsm8k)

    h = tools.add_parser("humaneval", help="HumanEval pass@1, completions run in a sandboxed subprocess")
    _common(h, 4)
    h.add_argument("--n", type=int, default=164)
    h.add_argument("--mode", choices=["chat", "completion"], default="chat")
    h.add_argument("--max-tokens", type=int, default=512)
    h.add_argument("--timeout-per-problem", type=float, default=10.0, help="seconds per sandboxed run")
    h.add_argument("--memory-mb", type=int, default=1024, help="address-space limit of a sandboxed run")
    _time_limit(h, "problems")
    h.set_defaults(func=_humaneval)


def add_eval(sub) -> None:
    e = sub.add_parser("eval", help="offline quality of a pack against its unquantized source")
    kinds = e.add_subparsers(dest="kind", required=True)
    q = kinds.add_parser("quality", help="KL divergence and perplexity, token by token")
    q.add_argument("model", help="the EXL3 pack (xmoe quantize output), or the URL of a vLLM server running it")
    q.add_argument("--reference", required=True, help="the unquantized source model directory, or a URL")
    q.add_argument("--text", help=f"text to score (default: {QUALITY_TEXT})")
    q.add_argument("--tokens", type=int, default=2048)
    q.add_argument("--window", type=int, default=512)
    q.add_argument("--groups", type=int, default=0, help="also swap in each of N layer groups alone (table)")
    q.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    q.add_argument("--device-map", help="e.g. auto: spread the model over GPUs and CPU (needs accelerate)")
    q.add_argument("--top-k", type=int, default=20, help="with URLs: prompt log-probabilities per token")
    q.add_argument("--api-key", default=os.environ.get("API_KEY"), help="with URLs (default: $API_KEY)")
    q.add_argument("--timeout", type=float, default=600.0, help="with URLs: seconds per request")
    q.add_argument("--json", metavar="PATH", help="write the full result, with KL per token, as JSON")
    q.set_defaults(func=_quality)
