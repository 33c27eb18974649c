"""The API key on every route but /health, and OpenAI-style 4xx errors for bad requests, on the shared
demo server; it must keep serving afterwards."""
import json

import httpx
import pytest


def _routes(demo_server) -> list[tuple[str, str]]:
    spec = httpx.get(demo_server.url + "/openapi.json", headers=_auth(demo_server.api_key), timeout=30).json()
    routes = [(method.upper(), path.replace("{", "").replace("}", "")) for path, ops in spec["paths"].items()
              for method in ops]
    return routes + [("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs")]


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _is_openai_error(r: httpx.Response, status: int | None = None) -> bool:
    body = r.json()
    ok = isinstance(body.get("error"), dict) and isinstance(body["error"].get("message"), str) and \
        isinstance(body["error"].get("type"), str)
    return ok and (r.status_code == status if status else 400 <= r.status_code < 500)


def test_api_key_required_on_every_route_but_health(demo_server):
    routes = _routes(demo_server)
    assert len(routes) > 10 and ("POST", "/v1/chat/completions") in routes and ("GET", "/version") in routes
    with httpx.Client(base_url=demo_server.url, timeout=30) as http:
        for method, path in routes:
            for headers in ({}, _auth("wrong-" + demo_server.api_key), {"Authorization": demo_server.api_key}):
                r = http.request(method, path, headers=headers)
                if path == "/health":
                    assert r.status_code == 200, (method, path, headers)
                else:
                    assert _is_openai_error(r, 401), (method, path, headers, r.status_code, r.text[:200])
                    assert r.json()["error"]["type"] == "authentication_error"
        for path in ("/v1/models", "/metrics", "/version", "/openapi.json"):
            assert http.get(path, headers=_auth(demo_server.api_key)).status_code == 200, path


def _chat(demo_server, **fields) -> dict:
    return {"model": demo_server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}


BAD = {
    "malformed JSON": lambda s: b'{"model": "x", "messages": [',
    "messages not a list": lambda s: json.dumps(_chat(s, messages="Hi")),
    "max_tokens not an integer": lambda s: json.dumps(_chat(s, max_tokens="ten")),
    "prompt longer than the context": lambda s: json.dumps(
        _chat(s, messages=[{"role": "user", "content": "word " * (s.options.max_model_len + 100)}])),
    "tool parameters not a schema": lambda s: json.dumps(
        _chat(s, tools=[{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}])),
    "tool without a name": lambda s: json.dumps(
        _chat(s, tools=[{"type": "function", "function": {"parameters": {"type": "object"}}}])),
    "tool_choice naming no given tool": lambda s: json.dumps(
        _chat(s, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
              tool_choice={"type": "function", "function": {"name": "g"}})),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_gets_an_openai_error(demo_server, case):
    r = httpx.post(demo_server.url + "/v1/chat/completions", content=BAD[case](demo_server),
                   headers={**_auth(demo_server.api_key), "Content-Type": "application/json"}, timeout=120)
    assert _is_openai_error(r), (r.status_code, r.text[:300])


@pytest.mark.parametrize("method,path,body,status", [
    ("GET", "/v1/no-such-route", None, 404),
    ("DELETE", "/v1/chat/completions", None, 405),
    ("POST", "/v1/chat/completions", b'{"model": "x", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
])
def test_http_layer_errors_are_openai_objects(demo_server, method, path, body, status):
    """What the HTTP layer under vLLM's handlers rejects (unknown path, wrong method, a body that is not
    UTF-8) comes back as an OpenAI error object too, not as {"detail": ...}."""
    r = httpx.request(method, demo_server.url + path, content=body, timeout=60,
                      headers={**_auth(demo_server.api_key), "Content-Type": "application/json"})
    assert _is_openai_error(r, status), (r.status_code, r.text[:300])
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_still_serving_after_bad_requests(demo_server):
    """Runs after the bad requests (pytest keeps file order)."""
    r = httpx.post(demo_server.base_url + "/chat/completions", json=_chat(demo_server, max_tokens=3),
                   headers=_auth(demo_server.api_key), timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert demo_server.alive()
