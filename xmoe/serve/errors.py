"""OpenAI-style error objects for every 4xx and 5xx of the server, as an ASGI middleware that vLLM's server
loads with `--middleware xmoe.serve.errors.OpenAIErrorMiddleware`.

vLLM's own handlers answer most bad requests as `{"error": {...}}`, but the HTTP layer beneath them does not:
Starlette's routing (unknown path, wrong method), FastAPI's body parsing (a body that is not UTF-8) and
vLLM's /v1 key check answer `{"detail": ...}` or `{"error": "Unauthorized"}`, which OpenAI clients cannot
read. This middleware rewrites such error bodies; bodies that already are OpenAI error objects pass as they are.
"""
import json
from http import HTTPStatus

# OpenAI's error types by status; any other 4xx is an invalid request, any 5xx a server error
TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def is_openai_error(body: object) -> bool:
    return isinstance(body, dict) and isinstance(body.get("error"), dict) and \
        isinstance(body["error"].get("message"), str)


def openai_error(status: int, body: bytes, method: str, path: str) -> bytes:
    """An error body as an OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = body.decode("utf-8", errors="replace").strip()
    detail = parsed.get("detail", parsed.get("error")) if isinstance(parsed, dict) else parsed
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = f"HTTP {status}"
    message = detail if isinstance(detail, str) and detail else json.dumps(detail) if detail else phrase
    if message in (phrase, "Unauthorized"):  # a bare status line: say what was asked
        message = f"{phrase}: {method} {path}"
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    code = phrase.lower().replace(" ", "_").replace("-", "_")
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class OpenAIErrorMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "HEAD":
            return await self.app(scope, receive, send)
        held: dict = {}  # an error response's start, held until its body is complete
        chunks: list[bytes] = []

        async def send_openai_style(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held["start"] = message
                return
            if "start" not in held or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            await _send_error(send, held["start"], b"".join(chunks), scope)

        return await self.app(scope, receive, send_openai_style)


async def _send_error(send, start: dict, body: bytes, scope) -> None:
    try:
        keep = is_openai_error(json.loads(body))
    except ValueError:
        keep = False
    if not keep:
        body = openai_error(start["status"], body, scope.get("method", ""), scope.get("path", ""))
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body})
