"""`xmoe bench toolcall`: tool-calling correctness on BFCL v4 items (categories `simple_python`, `multiple`).
The server gets OpenAI `tools`; its reply must call the expected function with arguments that each match one
of the values BFCL's `possible_answer` allows.

Matching, in our own words of BFCL's rules: the function name exactly; no argument BFCL does not list; every
listed argument present unless its allowed values include "" (BFCL's mark for "may be omitted"); strings equal
ignoring case, spaces and the characters ,./-_*^; an integer accepted where a float is expected; lists equal
element by element; dicts key by key, each value against its own list of allowed values."""
import json
import re
import time
from dataclasses import dataclass

from .client import Client, RequestError
from .data import bfcl_items
from .report import Reasons, Stop, parallel, shortfall

CATEGORIES = ("simple_python", "multiple")
TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}
KEEP = ("type", "description", "properties", "items", "required", "enum")
_PUNCT = re.compile(r"[\s,./\-_*^]")


@dataclass(frozen=True)
class ToolcallOptions:
    categories: tuple[str, ...] = CATEGORIES
    n: int = 50                 # items per category, from the start of each file
    max_tokens: int = 256
    concurrency: int = 8
    tool_choice: str = "auto"   # "required" makes vLLM constrain the reply to a call (slow on CPUs)
    time_limit: float = 300.0   # seconds after which no item is started (0: none), shared by the categories

    def __post_init__(self):
        unknown = [c for c in self.categories if c not in CATEGORIES]
        if unknown or self.n < 1 or self.time_limit < 0:
            raise ValueError(f"toolcall: categories must be among {', '.join(CATEGORIES)} (got "
                             f"{', '.join(self.categories)}), --n >= 1 (got {self.n}) and --time-limit >= 0 "
                             f"(got {self.time_limit})")


def schema(s):
    """A BFCL parameter schema as JSON Schema: its 'dict'/'float'/'tuple'/'any' types mapped, other keys dropped."""
    if not isinstance(s, dict):
        return s
    out = {k: v for k, v in s.items() if k in KEEP and k != "properties"}
    if "type" in s:
        mapped = TYPES.get(s["type"], s["type"])
        out.pop("type")
        if mapped:
            out["type"] = mapped
    if "properties" in s:
        out["properties"] = {k: schema(v) for k, v in s["properties"].items()}
    if "items" in s:
        out["items"] = schema(s["items"])
    return out


def tool_name(name: str) -> str:
    """OpenAI tool names allow [A-Za-z0-9_-] only; BFCL's have dots ('math.factorial')."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


def tools(functions: list[dict]) -> list[dict]:
    return [{"type": "function", "function": {"name": tool_name(f["name"]), "description": f.get("description", ""),
                                               "parameters": schema(f["parameters"])}} for f in functions]


def same(got, want) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return got is want
    if isinstance(want, (int, float)):
        return isinstance(got, (int, float)) and (isinstance(want, float) or isinstance(got, int)) and got == want
    if isinstance(want, str):
        return isinstance(got, str) and _PUNCT.sub("", got.lower()) == _PUNCT.sub("", want.lower())
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(map(same, got, want))
    if isinstance(want, dict):
        return isinstance(got, dict) and check_args(got, want) is None
    return got == want


def check_args(args: dict, allowed: dict) -> str | None:
    """None when every argument matches one allowed value, else why not."""
    for k, v in args.items():
        if k not in allowed:
            return f"unexpected argument {k!r}"
        if not any(same(v, a) for a in allowed[k] if a != ""):
            return f"wrong value for {k!r}: {v!r}"
    missing = [k for k, vals in allowed.items() if k not in args and "" not in vals]
    return f"missing argument {missing[0]!r}" if missing else None


def check_calls(calls: list[tuple[str, dict]], ground_truth: list[dict]) -> str | None:
    """None when the calls equal the expected ones (one expected call for simple/multiple), else why not."""
    if len(calls) != len(ground_truth):
        return f"{len(calls)} calls, expected {len(ground_truth)}"
    for (name, args), expected in zip(calls, ground_truth):
        (want_name, allowed), = expected.items()
        if tool_name(name) != tool_name(want_name):
            return f"called {name!r}, expected {want_name!r}"
        why = check_args(args, allowed)
        if why:
            return why
    return None


def parse_calls(message: dict) -> list[tuple[str, dict]]:
    calls = []
    for c in message.get("tool_calls") or []:
        f = c.get("function", {})
        args = f.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise ValueError(f"arguments of {f.get('name')!r} are not JSON: {args[:100]!r}") from None
        calls.append((f.get("name", ""), args if isinstance(args, dict) else {"": args}))
    return calls


def probe(client: Client, item: dict, opts: ToolcallOptions) -> dict:
    out = {"id": item["id"], "passed": False, "calls": None, "reason": None, "error": None, "content": None}
    try:
        r = client.chat(item["question"][0], opts.max_tokens, tools=tools(item["function"]),
                        tool_choice=opts.tool_choice)
        out["content"] = r["choices"][0]["message"].get("content")
        out["calls"] = parse_calls(r["choices"][0]["message"])
    except RequestError as e:
        return {**out, "error": str(e)}
    except ValueError as e:
        return {**out, "reason": str(e)}
    out["reason"] = check_calls(out["calls"], item["ground_truth"])
    return {**out, "passed": out["reason"] is None}


def run(client: Client, opts: ToolcallOptions) -> dict:
    """The first `n` items of each category, as many as the time limit allows: category k of K may run until
    k/K of it has passed, so a slow server still scores every category."""
    result, t0 = {"model": client.model, "tool_choice": opts.tool_choice, "categories": []}, time.monotonic()
    for k, cat in enumerate(opts.categories, 1):
        items = bfcl_items(cat)[: opts.n]
        stop = Stop(t0 + opts.time_limit * k / len(opts.categories) if opts.time_limit else None)
        got = [g for g in parallel(lambda it: probe(client, it, opts), items, opts.concurrency, f"toolcall {cat}",
                                   stop) if g is not None]
        result["categories"].append({"category": cat, "n": len(got), "asked": len(items), "stopped": stop.reason,
                                     "time_limit": opts.time_limit, "passed": sum(g["passed"] for g in got),
                                     "accuracy": sum(g["passed"] for g in got) / max(len(got), 1),
                                     "no_call": sum(g["calls"] == [] for g in got),
                                     "errors": sum(bool(g["error"]) for g in got), "items": got})
        if stop.reason == "interrupted":
            break
    return result


def rows(result: dict) -> tuple[list[dict], list[str]]:
    """(a row per category, notes) for the printout; failed requests are counted with their reasons."""
    why = Reasons()
    out = [{**{k: c[k] for k in ("category", "n", "passed", "accuracy", "no_call")},
            "failed": why.cell(i["error"] for i in c["items"])} for c in result["categories"]]
    short = [line for c in result["categories"] for line in
             shortfall(c["stopped"], c["n"], c["asked"], f"{c['category']} items", c["time_limit"])]
    return out, [*short, *why.lines()]
