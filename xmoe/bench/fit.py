"""Prompts cut to a token length as the server itself counts tokens.

Token density varies along a text (verse numbers, legal prose, code), so a characters-per-token ratio taken
from one sample misses by tens of percent elsewhere. Each prompt is therefore counted and its cut moved until
it lands just under the target."""
from dataclasses import dataclass
from typing import Callable

from .client import Client, RequestError

SAMPLES = 8             # pieces of the text the first characters-per-token guess is taken from
SAMPLE_CHARS = 200      # each: the whole sample is some 400 tokens, under any context worth measuring


class Counter:
    """Prompt tokens of chat messages as the server counts them: its /tokenize route where it has one (no
    generation, no cache entry), else the `usage` of a one-token request (a prefill each)."""

    def __init__(self, client: Client):
        self.client = client
        self.exact = client.count_tokens([{"role": "user", "content": "Hello"}]) is not None
        self.method = "/tokenize" if self.exact else "usage of one-token requests"

    def __call__(self, messages: list[dict]) -> int:
        n = self.client.count_tokens(messages) if self.exact else None
        return n if n is not None else self.client.chat(messages, 1)["usage"]["prompt_tokens"]


@dataclass(frozen=True)
class Fitted:
    messages: list[dict]
    tokens: int             # as the server counts them
    chars: int              # characters of text inside


def chars_per_token(count: Counter, text: str, build: Callable[[str], list[dict]]) -> float:
    """Characters per token of `text` inside the prompt `build(text)`, from pieces spread over the text (a
first guess for `fit`; 4, typical of English, where the server refuses even the sample)."""
    step = max(len(text) // SAMPLES, 1)
    sample = "\n".join(text[i: i + SAMPLE_CHARS] for i in range(0, len(text), step)[:SAMPLES])
    try:
        return len(sample) / max(count(build(sample)) - count(build("")), 1)
    except RequestError as e:
        if e.status != 400:
            raise
        return 4.0


def fit(build: Callable[[int], list[dict]], target: int, count: Counter, cpt: float,
        slack: float = 0.01) -> Fitted:
    """build(chars) for the number of characters that gives the most tokens up to `target`, stopping once
    within `slack` of it; `cpt` (characters per token) makes the first guess. Raises ValueError when even an
    empty text is over `target`, and the server's error when it refuses every length tried."""
    base = count(build(0))
    if base >= target:
        raise ValueError(f"the prompt around the text alone is {base} tokens, not under the {target} asked for")
    low = target - max(2, int(target * slack))          # the accepted band: [low, target]
    aim = (low + target + 1) // 2                       # its middle, not its edge
    chars, best, refused = max(int((aim - base) * cpt), 1), None, None
    for _ in range(8):
        messages = build(chars)
        try:
            n = count(messages)
        except RequestError as e:           # counting by usage: a prompt over the context is refused
            if e.status != 400:
                raise
            chars, refused = int(chars * 0.8), e
            continue
        if n <= target and (best is None or n > best.tokens):
            best = Fitted(messages, n, chars)
        if low <= n <= target:
            break
        chars = max(1, round(chars * (aim - base) / (n - base))) if n > base else chars * 2
    if refused and (best is None or best.tokens < low):     # the server's reason, not a much shorter prompt
        raise refused
    if best is None:
        raise ValueError(f"no cut of the text came under {target} tokens")
    return best
