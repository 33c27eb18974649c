"""API-key check on every route but /health, as an ASGI middleware that vLLM's server loads with
`--middleware xmoe.serve.auth.ApiKeyMiddleware` (vLLM's own check guards only /v1 and friends).

vLLM adds middlewares by import path without arguments, so the keys come from the server's own settings:
its `--api-key` values, else VLLM_API_KEY, exactly the keys vLLM's /v1 guard accepts. Rejections are
OpenAI-style error objects with status 401.
"""
import hmac
import json

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no credentials


def _keys(scope) -> list[str]:
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    keys = list(getattr(args, "api_key", None) or [])
    if not keys:
        from vllm import envs
        keys = [envs.VLLM_API_KEY] if envs.VLLM_API_KEY else []
    return keys


def _given(scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def error_body(message: str, kind: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def _is_preflight(scope) -> bool:
    """A CORS preflight: browsers send it without credentials by design; the CORS layer answers it."""
    names = {name for name, _ in scope.get("headers", [])}
    return scope.get("method") == "OPTIONS" and {b"origin", b"access-control-request-method"} <= names


class ApiKeyMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or _is_preflight(scope):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        keys, given = _keys(scope), _given(scope)
        if not keys:  # fail closed: the middleware is only installed when a key is wanted
            return await _reject(scope, send, 500, "server misconfigured: API key middleware without a key",
                                 "server_error", "server_error")
        if given is None:
            return await _reject(scope, send, 401, "Missing API key: send 'Authorization: Bearer <key>'.",
                                 "authentication_error", "missing_api_key")
        if not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
            return await _reject(scope, send, 401, "Incorrect API key provided.",
                                 "authentication_error", "invalid_api_key")
        return await self.app(scope, receive, send)


async def _reject(scope, send, status: int, message: str, kind: str, code: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})  # policy violation; the client sees a 403
        return
    body = error_body(message, kind, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
