"""A small HTTP client for OpenAI-compatible servers: chat and text completions, streaming with timings,
/v1/models and the Prometheus /metrics page. Errors name the URL and carry the server's message."""
import json
import time
from dataclasses import dataclass

import httpx


class RequestError(OSError):
    """A request that failed: connection refused, timeout, or an HTTP error status (the message says which;
    `status` holds the HTTP status when there was one)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class _NoResponse(Exception):
    """The server closed the connection before answering."""


@dataclass(frozen=True)
class Endpoint:
    url: str                    # base URL, with or without a trailing /v1
    api_key: str | None = None
    model: str | None = None    # None: the server's first model in /v1/models
    timeout: float = 600.0


@dataclass(frozen=True)
class StreamResult:
    text: str
    completion_tokens: int      # from the final usage chunk when the server sends one, else chunks counted
    prompt_tokens: int | None
    t_start: float              # perf_counter at send
    t_first: float              # first content token arrived
    t_last: float               # last content token arrived

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second after the first one (None when there is only one token)."""
        span = self.t_last - self.t_first
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 else None


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class Client:
    def __init__(self, endpoint: Endpoint):
        self.base = _base(endpoint.url)
        headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
        # Idle connections are dropped before the server's keep-alive timeout (uvicorn: 5 s), so that a request
        # is rarely sent on a connection the server is closing; one that is gets sent again (see _request).
        self.http = httpx.Client(headers=headers, timeout=endpoint.timeout,
                                 limits=httpx.Limits(max_connections=256, max_keepalive_connections=64,
                                                     keepalive_expiry=2.0))
        self._cards: list[dict] | None = None
        self._tokenize = True                   # until the server shows it has no /tokenize route
        self.model = endpoint.model or self.models()[0]

    def _request(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        url = self.base + path
        try:
            try:
                r = self.http.request(method, url, json=body)
            except httpx.RemoteProtocolError:   # closed by the server before any response: safe to resend
                r = self.http.request(method, url, json=body)
        except httpx.HTTPError as e:
            raise RequestError(f"{url}: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            raise RequestError(f"{url}: HTTP {r.status_code}: {_message(r)}", r.status_code)
        return r

    def cards(self) -> list[dict]:
        """The entries of /v1/models (fetched once)."""
        if self._cards is None:
            cards = [m for m in self._request("GET", "/v1/models").json().get("data", []) if m.get("id")]
            if not cards:
                raise RequestError(f"{self.base}/v1/models: the server lists no model")
            self._cards = cards
        return self._cards

    def models(self) -> list[str]:
        return [m["id"] for m in self.cards()]

    def context_length(self) -> int | None:
        """The served model's context length in tokens, prompt and reply together, where the server states it
        (vLLM: `max_model_len` in /v1/models); None where it does not."""
        for m in self.cards():
            n = m.get("max_model_len")
            if m["id"] == self.model and isinstance(n, int) and n > 0:
                return n
        return None

    def count_tokens(self, messages: list[dict]) -> int | None:
        """Prompt tokens of a chat request as the server counts them, chat template included (vLLM's
        /tokenize: no generation, no cache entry); None where the server has no such route."""
        if not self._tokenize:
            return None
        try:
            r = self._request("POST", "/tokenize", {"model": self.model, "messages": messages})
            count = r.json().get("count")
        except RequestError as e:
            if e.status not in (400, 404, 405, 422, 501):    # a missing route, or one that wants another body
                raise
            count = None
        except ValueError:                      # a page that is not JSON: no such route either
            count = None
        if not isinstance(count, int):
            self._tokenize = False
            return None
        return count

    def metrics(self) -> str:
        """The Prometheus text page at /metrics (vLLM exports one; other servers may not)."""
        return self._request("GET", "/metrics").text

    def chat(self, messages: list[dict], max_tokens: int, **params) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **params}
        return _completion(self._request("POST", "/v1/chat/completions", body))

    def complete(self, prompt, max_tokens: int, **params) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **params}
        return _completion(self._request("POST", "/v1/completions", body))

    def stream_chat(self, messages: list[dict], max_tokens: int, **params) -> StreamResult:
        try:
            return self._stream_chat(messages, max_tokens, **params)
        except _NoResponse:                     # closed by the server before any response: safe to resend
            try:
                return self._stream_chat(messages, max_tokens, **params)
            except _NoResponse as e:
                raise RequestError(f"{self.base}/v1/chat/completions: {e.__cause__}") from e

    def _stream_chat(self, messages: list[dict], max_tokens: int, **params) -> StreamResult:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, **params}
        url = self.base + "/v1/chat/completions"
        t0 = time.perf_counter()
        parts, times, usage, answered = [], [], None, False
        try:
            with self.http.stream("POST", url, json=body) as r:
                answered = True
                if r.status_code >= 400:
                    r.read()
                    raise RequestError(f"{url}: HTTP {r.status_code}: {_message(r)}", r.status_code)
                for chunk in _events(r, url):
                    usage = chunk.get("usage") or usage
                    for c in chunk.get("choices", []):
                        delta = c.get("delta", {})
                        if delta.get("content") or delta.get("reasoning_content"):
                            parts.append(delta.get("content") or "")
                            times.append(time.perf_counter())
        except httpx.RemoteProtocolError as e:
            if not answered:
                raise _NoResponse() from e
            raise RequestError(f"{url}: {type(e).__name__}: {e}") from e
        except httpx.HTTPError as e:
            raise RequestError(f"{url}: {type(e).__name__}: {e}") from e
        if not times:
            raise RequestError(f"{url}: the stream ended without any token")
        n = usage["completion_tokens"] if usage else len(times)
        return StreamResult("".join(parts), n, usage and usage.get("prompt_tokens"), t0, times[0], times[-1])


def _events(r: httpx.Response, url: str):
    """The JSON objects of a server-sent event stream, up to [DONE]."""
    for line in r.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise RequestError(f"{url}: error in stream: {_text(chunk['error'])}")
        yield chunk


def _completion(r: httpx.Response) -> dict:
    """A completion's JSON, checked for the choices every caller reads: a malformed reply fails that request
    alone, as an HTTP error does."""
    try:
        body = r.json()
    except ValueError:
        raise RequestError(f"{r.request.url}: the reply is not JSON: {r.text[:200]!r}") from None
    if not isinstance(body, dict) or not body.get("choices"):
        raise RequestError(f"{r.request.url}: a reply without choices: {str(body)[:200]}")
    return body


def _message(r: httpx.Response) -> str:
    try:
        return _text(r.json().get("error", r.json()))
    except ValueError:
        return r.text[:300]


def _text(err) -> str:
    return err.get("message", str(err))[:300] if isinstance(err, dict) else str(err)[:300]
