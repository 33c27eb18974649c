"""The API-key middleware on a small Starlette app (no vLLM): what vLLM's server gets via --middleware."""
from types import SimpleNamespace

import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from xmoe.serve.auth import ApiKeyMiddleware  # noqa: E402


def app(keys):
    ok = lambda request: JSONResponse({"ok": True})  # noqa: E731
    a = Starlette(routes=[Route(p, ok, methods=["GET", "POST", "OPTIONS"])
                          for p in ("/health", "/v1/models", "/metrics", "/tokenize", "/healthz")])
    a.state.args = SimpleNamespace(api_key=keys)
    a.add_middleware(ApiKeyMiddleware)
    return TestClient(a)


def test_health_open_everything_else_guarded():
    c = app(["k1", "k2"])
    assert c.get("/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/tokenize", "/healthz"):
        for headers, code in (({}, "missing_api_key"), ({"Authorization": "Bearer nope"}, "invalid_api_key"),
                              ({"Authorization": "Basic k1"}, "missing_api_key")):
            r = c.post(path, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "authentication_error",
                                          "param": None, "code": code}}
        assert c.get(path, headers={"Authorization": "Bearer k2"}).json() == {"ok": True}


def test_cors_preflight_passes_plain_options_does_not():
    c = app(["k"])
    assert c.options("/v1/models").status_code == 401
    r = c.options("/v1/models", headers={"Origin": "http://x", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200


def test_no_key_configured_fails_closed(monkeypatch):
    envs = pytest.importorskip("vllm.envs")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert not envs.VLLM_API_KEY
    r = app(None).get("/v1/models", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_key_from_vllm_environment(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    c = app(None)
    assert c.get("/v1/models", headers={"Authorization": "Bearer env-key"}).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "Bearer other"}).status_code == 401
