"""`xmoe bench gsm8k`: grade-school math, greedy, answers in the "#### N" format. Accuracy against the data's
answers and, when a second endpoint is given (e.g. the unquantized model), agreement with its answers."""
import re
import time
from dataclasses import dataclass

from .client import Client, RequestError
from .data import gsm8k
from .report import Reasons, Stop, parallel, shortfall

PROMPT = ("Solve this math problem step by step. End your reply with a line of the form '#### N' where N is "
          "the final numeric answer.\n\n{question}")
_MARKED = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*|-?\.\d+")


@dataclass(frozen=True)
class Gsm8kOptions:
    n: int = 200
    max_tokens: int = 512
    concurrency: int = 8
    data: str | None = None     # path to test.jsonl; None: the cached copy
    time_limit: float = 300.0   # seconds after which no problem is started (0: none); see `run`

    def __post_init__(self):
        if self.n < 1 or self.time_limit < 0:
            raise ValueError(f"gsm8k: need --n >= 1 and --time-limit >= 0, got {self.n} and {self.time_limit}")


def normalize(number: str) -> str:
    """'1,000.50' -> '1000.5', '-3.0' -> '-3': one spelling per value."""
    x = float(number.replace(",", ""))
    return str(int(x)) if x == int(x) else repr(x)


def extract(text: str) -> str | None:
    """The final answer of a reply: the last '#### N', else the last number in the text, else None."""
    marked = _MARKED.findall(text)
    numbers = marked or _NUMBER.findall(text)
    for candidate in reversed(numbers):
        try:
            return normalize(candidate.rstrip("."))
        except ValueError:
            continue
    return None


def ask(client: Client, question: str, opts: Gsm8kOptions) -> dict:
    try:
        r = client.chat([{"role": "user", "content": PROMPT.format(question=question)}], opts.max_tokens)
    except RequestError as e:
        return {"reply": None, "answer": None, "error": str(e)}
    reply = r["choices"][0]["message"].get("content") or ""
    return {"reply": reply, "answer": extract(reply), "error": None}


def run(client: Client, opts: Gsm8kOptions, other: Client | None = None) -> dict:
    """The first `n` problems, as many as the time limit allows (a slow server scores fewer rather than run
    for hours; `stopped` says so); a second endpoint answers the same problems."""
    problems = gsm8k(opts.data)[: opts.n]
    stop = Stop(time.monotonic() + opts.time_limit if opts.time_limit else None)
    got = parallel(lambda p: ask(client, p["question"], opts), problems, opts.concurrency, "gsm8k", stop)
    kept = [i for i, g in enumerate(got) if g is not None]
    problems, got = [problems[i] for i in kept], [got[i] for i in kept]
    truth = [extract(p["answer"]) for p in problems]
    result = {"model": client.model, "endpoint": client.base, "n": len(problems), "asked": opts.n,
              "stopped": stop.reason, "time_limit": opts.time_limit, **score(truth, got)}
    ref = [None] * len(got)
    if other is not None:
        ref = parallel(lambda p: ask(other, p["question"], opts), problems, opts.concurrency, "gsm8k (other)")
        if None in ref:                     # interrupted: compare the problems both answered
            kept = [i for i, r in enumerate(ref) if r is not None]
            problems, truth, got, ref = ([xs[i] for i in kept] for xs in (problems, truth, got, ref))
            result.update(n=len(problems), stopped="interrupted", **score(truth, got))
        result.update(other_model=other.model, other_endpoint=other.base, other=score(truth, ref),
                      **agreement(got, ref))
    result["items"] = [{"question": p["question"], "truth": t, **g, "other": o}
                       for p, t, g, o in zip(problems, truth, got, ref)]
    return result


def score(truth: list[str | None], got: list[dict]) -> dict:
    correct = sum(g["answer"] is not None and g["answer"] == t for t, g in zip(truth, got))
    return {"correct": correct, "accuracy": correct / max(len(got), 1),
            "no_answer": sum(g["answer"] is None and not g["error"] for g in got),
            "errors": sum(bool(g["error"]) for g in got)}


def agreement(got: list[dict], ref: list[dict]) -> dict:
    """Share of problems where both endpoints give the same final answer, and the same reply text."""
    n = max(len(got), 1)
    return {"answer_agreement": sum(a["answer"] == b["answer"] for a, b in zip(got, ref)) / n,
            "text_agreement": sum(a["reply"] is not None and a["reply"] == b["reply"] for a, b in zip(got, ref)) / n}


def rows(result: dict) -> tuple[list[dict], list[str]]:
    """(a row per endpoint, notes) for the printout; failed requests are counted with their reasons."""
    why = Reasons()
    out = [{"endpoint": result["endpoint"], "model": result["model"], "n": result["n"], "accuracy": result["accuracy"],
            "no answer": result["no_answer"], "failed": why.cell(i["error"] for i in result["items"])}]
    if "other" in result:
        o = result["other"]
        out.append({"endpoint": result["other_endpoint"], "model": result["other_model"], "n": result["n"],
                    "accuracy": o["accuracy"], "no answer": o["no_answer"],
                    "failed": why.cell(i["other"]["error"] for i in result["items"])})
        for r in out:
            r.update({"answer agreement": result["answer_agreement"], "text agreement": result["text_agreement"]})
    return out, [*shortfall(result["stopped"], result["n"], result["asked"], "problems", result["time_limit"]),
                 *why.lines()]
