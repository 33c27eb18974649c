"""OpenAI-style error objects for what the HTTP layer rejects, on a small FastAPI app (no vLLM): what vLLM's
server gets via --middleware."""
import pytest

pytest.importorskip("fastapi")
from fastapi import FastAPI, HTTPException  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from starlette.responses import JSONResponse, PlainTextResponse  # noqa: E402

from xmoe.serve.errors import OpenAIErrorMiddleware  # noqa: E402


class Chat(BaseModel):
    model: str


def client() -> TestClient:
    app = FastAPI()

    @app.post("/v1/chat")
    async def chat(body: Chat):
        return {"model": body.model}

    @app.get("/v1/openai-error")
    async def already():
        return JSONResponse({"error": {"message": "kept", "type": "x", "param": "p", "code": 7}}, status_code=400)

    @app.get("/v1/teapot")
    async def teapot():
        raise HTTPException(418, detail={"why": "short and stout"})

    @app.get("/v1/text")
    async def text():
        return PlainTextResponse("upstream went away", status_code=502)

    app.add_middleware(OpenAIErrorMiddleware)
    return TestClient(app)


def error(r, status: int) -> dict:
    assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert int(r.headers["content-length"]) == len(r.content)
    return body["error"]


def test_http_layer_errors_are_openai_objects():
    c = client()
    e = error(c.get("/nowhere"), 404)
    assert e == {"message": "Not Found: GET /nowhere", "type": "not_found_error", "param": None, "code": "not_found"}
    r = c.delete("/v1/chat")
    e = error(r, 405)
    assert e["message"] == "Method Not Allowed: DELETE /v1/chat" and e["type"] == "invalid_request_error"
    assert r.headers["allow"] == "POST"  # the other headers stay
    e = error(c.post("/v1/chat", content=b'{"model": "\xff\xfe"}', headers={"Content-Type": "application/json"}), 400)
    assert e["type"] == "invalid_request_error" and "pars" in e["message"]
    assert error(c.get("/v1/teapot"), 418)["message"] == '{"why": "short and stout"}'
    e = error(c.get("/v1/text"), 502)
    assert e == {"message": "upstream went away", "type": "server_error", "param": None, "code": "bad_gateway"}


def test_openai_errors_and_successes_pass_unchanged():
    c = client()
    assert c.get("/v1/openai-error").json() == {"error": {"message": "kept", "type": "x", "param": "p", "code": 7}}
    r = c.post("/v1/chat", json={"model": "m"})
    assert r.status_code == 200 and r.json() == {"model": "m"}
    assert c.head("/nowhere").status_code == 404  # no body on HEAD, none added
