"""`xmoe bench needle`: a synthetic fact ("The secret code is 48151623.") hidden at a given depth of a long
public-domain text cut to a given context length; the reply passes when it contains the code."""
import random
from dataclasses import dataclass

from .client import Client, RequestError
from .report import parallel
from .texts import chars_per_token, long_text

NEEDLE = "The secret code is {code}."
QUESTION = "What is the secret code mentioned in the text above? Reply with the number only."


@dataclass(frozen=True)
class NeedleOptions:
    context: int = 4096                                    # target prompt length in tokens
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


def run(client: Client, opts: NeedleOptions) -> dict:
    text, source = long_text(opts.text)
    cpt, overhead = chars_per_token(client, text, messages)
    budget = opts.context - overhead - 16                  # the needle sentence
    length = int(budget * cpt * 0.97)                       # a margin: token density varies along the text
    rng = random.Random(opts.seed)
    trials = [{"depth": d, "code": str(rng.randrange(10_000_000, 99_999_999)), "start": rng.randrange(len(text))}
              for d in opts.depths for _ in range(opts.trials)]

    def probe(t: dict) -> dict:
        prompt = hide(text, t["start"], length, t["depth"], NEEDLE.format(code=t["code"]))
        try:
            r = client.chat(messages(prompt), opts.max_tokens)
        except RequestError as e:
            return {**t, "passed": False, "reply": None, "prompt_tokens": None, "error": str(e)}
        reply = r["choices"][0]["message"].get("content") or ""
        return {**t, "passed": t["code"] in reply, "reply": reply, "prompt_tokens": r["usage"]["prompt_tokens"],
                "error": None}

    items = parallel(probe, trials, opts.concurrency, f"needle @ {opts.context} tokens")
    per_depth = []
    for d in opts.depths:
        mine = [i for i in items if i["depth"] == d]
        tokens = [i["prompt_tokens"] for i in mine if i["prompt_tokens"]]
        per_depth.append({"depth": d, "trials": len(mine), "passed": sum(i["passed"] for i in mine),
                          "pass_rate": sum(i["passed"] for i in mine) / len(mine),
                          "prompt_tokens": round(sum(tokens) / len(tokens)) if tokens else None,
                          "errors": sum(bool(i["error"]) for i in mine)})
    return {"model": client.model, "context": opts.context, "text": source, "chars_per_token": cpt,
            "pass_rate": sum(i["passed"] for i in items) / len(items), "depths": per_depth, "items": items}
