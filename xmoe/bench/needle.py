"""`xmoe bench needle`: a synthetic fact ("The secret code is 48151623.") hidden at a given depth of a long
public-domain text cut to a given context length; the reply passes when it contains the code. Each prompt is
cut to the length the server counts, just under the context asked for, and that fits the server's context."""
import random
from dataclasses import dataclass

from .client import Client, RequestError
from .fit import Counter, chars_per_token, fit
from .report import Reasons, Stop, parallel
from .texts import long_text

NEEDLE = "The secret code is {code}."
QUESTION = "What is the secret code mentioned in the text above? Reply with the number only."


@dataclass(frozen=True)
class NeedleOptions:
    context: int = 4096                                    # target prompt length in tokens (at most)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    trials: int = 2                                        # per depth, each with its own code and text window
    max_tokens: int = 24
    concurrency: int = 4
    text: str | None = None                                # a text file; default: the KJV or the license texts
    seed: int = 0

    def __post_init__(self):
        if self.context < 64 or not all(0 <= d <= 1 for d in self.depths) or self.trials < 1:
            raise ValueError(f"needle: need --context >= 64, depths in [0, 1] and --trials >= 1, got "
                             f"{self.context}, {list(self.depths)}, {self.trials}")


def messages(haystack: str) -> list[dict]:
    return [{"role": "user", "content": f"{haystack}\n\n{QUESTION}"}]


def hide(text: str, start: int, length: int, depth: float, needle: str) -> str:
    """`length` characters of `text` from `start` (wrapping around), the needle at a sentence end near `depth`."""
    body = (text * (1 + (start + length) // len(text)))[start: start + length]
    at = int(depth * len(body))
    cut = max(body.rfind(". ", 0, at), body.rfind("\n", 0, at))
    at = 0 if at == 0 or cut < 0 else cut + 1
    return f"{body[:at].rstrip()} {needle} {body[at:].lstrip()}".strip()


def fit_context(opts: NeedleOptions, server: int | None) -> tuple[int, list[str]]:
    """(prompt tokens to aim at, notes): the length asked for, cut where the server's context must also hold
    the reply."""
    if server is None:
        return opts.context, [f"the server does not state its context length: prompts of {opts.context} tokens "
                              f"as asked"]
    room = server - opts.max_tokens
    if room < 64:
        raise ValueError(f"needle: the server's context of {server} tokens leaves no room for a haystack beside "
                         f"a {opts.max_tokens}-token reply")
    if opts.context <= room:
        return opts.context, []
    return room, [f"prompts of {room} tokens, not {opts.context}: the server's context is {server} tokens and "
                  f"the reply needs {opts.max_tokens}"]


def run(client: Client, opts: NeedleOptions) -> dict:
    text, source = long_text(opts.text)
    context, notes = fit_context(opts, client.context_length())
    count = Counter(client)
    cpt = chars_per_token(count, text, messages)
    rng = random.Random(opts.seed)
    trials = [{"depth": d, "code": str(rng.randrange(10_000_000, 99_999_999)), "start": rng.randrange(len(text))}
              for d in opts.depths for _ in range(opts.trials)]

    def probe(t: dict) -> dict:
        needle = NEEDLE.format(code=t["code"])
        try:
            prompt = fit(lambda n: messages(hide(text, t["start"], n, t["depth"], needle)), context, count, cpt)
            r = client.chat(prompt.messages, opts.max_tokens)
        except (RequestError, ValueError) as e:
            return {**t, "passed": False, "reply": None, "prompt_tokens": None, "error": str(e)}
        reply = r["choices"][0]["message"].get("content") or ""
        return {**t, "passed": t["code"] in reply, "reply": reply, "prompt_tokens": r["usage"]["prompt_tokens"],
                "error": None}

    stop = Stop()
    items = [i for i in parallel(probe, trials, opts.concurrency, f"needle @ {context} tokens", stop) if i]
    notes += [f"interrupted: {len(items)} of {len(trials)} trials run"] if stop.reason else []
    answered = [i for i in items if not i["error"]]
    return {"model": client.model, "context": context, "asked": opts.context, "notes": notes, "text": source,
            "counted_by": count.method, "chars_per_token": cpt, "answered": len(answered),
            "pass_rate": sum(i["passed"] for i in answered) / len(answered) if answered else None,
            "depths": [depth_row(d, [i for i in items if i["depth"] == d]) for d in opts.depths], "items": items}


def depth_row(depth: float, items: list[dict]) -> dict:
    """Trials at one depth; the pass rate is over those the server answered (failures are counted apart)."""
    tokens = [i["prompt_tokens"] for i in items if i["prompt_tokens"]]
    answered = [i for i in items if not i["error"]]
    return {"depth": depth, "trials": len(items), "passed": sum(i["passed"] for i in items),
            "pass_rate": sum(i["passed"] for i in answered) / len(answered) if answered else None,
            "prompt_tokens": round(sum(tokens) / len(tokens)) if tokens else None,
            "prompt_tokens_min": min(tokens, default=None), "prompt_tokens_max": max(tokens, default=None),
            "errors": len(items) - len(answered)}


def rows(result: dict) -> tuple[list[dict], list[str]]:
    """(rows per depth, notes) for the printout; failed requests are counted with their reasons."""
    why = Reasons()
    out = []
    for d in result["depths"]:
        lo, hi = d["prompt_tokens_min"], d["prompt_tokens_max"]
        out.append({"depth": d["depth"], "trials": d["trials"], "passed": d["passed"], "pass rate": d["pass_rate"],
                    "prompt tokens": lo if lo == hi else f"{lo}-{hi}",
                    "failed": why.cell(i["error"] for i in result["items"] if i["depth"] == d["depth"])})
    return out, [*result["notes"], *why.lines()]
