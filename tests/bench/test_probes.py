"""Probes fitted to the server: prompt lengths as the server counts them, lengths cut to its context, and a
step that fails kept in the table with its reason. Against a server in the test process (an httpx mock) that
shows what the demo server cannot: no stated context length, no /tokenize route, longer prompts refused."""
import json
import re

import httpx
import pytest

from xmoe.bench import gsm8k, needle, replay, report, speed
from xmoe.bench.client import Client, Endpoint, StreamResult
from xmoe.bench.fit import Counter, fit
from xmoe.bench.texts import long_text

WORD = re.compile(r"\w+|[^\w\s]")       # a token per word or punctuation mark: density varies along a text
CODE = re.compile(r"secret code is (\d+)")


class FakeServer:
    def __init__(self, context: int = 2048, overhead: int = 7):
        self.context, self.overhead = context, overhead
        self.answered: list[int] = []       # prompt tokens of every chat request answered

    def tokens(self, messages: list[dict]) -> int:
        return self.overhead + sum(len(WORD.findall(m["content"])) for m in messages)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake"}]})
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(404, json={"error": {"message": "Not Found"}})
        body = json.loads(request.content)
        n = self.tokens(body["messages"])
        if n > self.context:
            return httpx.Response(400, json={"error": {"message": f"This model's maximum context length is "
                                                       f"{self.context} tokens. However, your prompt contains {n} "
                                                       f"input tokens."}})
        self.answered.append(n)
        code = CODE.search(body["messages"][-1]["content"])
        out = body.get("min_tokens") or min(body["max_tokens"], 3)
        return httpx.Response(200, json={"choices": [{"message": {"content": code.group(1) if code else "ok"}}],
                                         "usage": {"prompt_tokens": n, "completion_tokens": out}})

    def client(self) -> Client:
        c = Client(Endpoint("http://fake/v1", model="fake"))
        c.http = httpx.Client(transport=httpx.MockTransport(self.handle))
        return c


@pytest.fixture
def text():
    return long_text(quiet=True)[0]


def test_fit_lands_just_under_the_target_anywhere_in_the_text(text):
    server = FakeServer(context=100_000)
    count = Counter(server.client())
    assert not count.exact                                  # no /tokenize: counted by usage
    for start in range(0, len(text), len(text) // 7):
        for target in (100, 1000, 3000):
            build = lambda n: [{"role": "user", "content": (text * 2)[start: start + n]}]
            got = fit(build, target, count, cpt=4.0)        # a poor first guess on purpose
            assert target * 0.98 <= got.tokens <= target and got.tokens == server.tokens(got.messages)


def test_fit_says_why_it_cannot(text):
    count = Counter(FakeServer(context=500).client())
    build = lambda n: [{"role": "user", "content": "Continue: " + text[:n]}]
    with pytest.raises(ValueError, match="alone is 9 tokens, not under the 8 asked for"):
        fit(build, 8, count, 4.0)
    with pytest.raises(OSError, match="maximum context length is 500 tokens"):
        fit(build, 1000, count, 4.0)                        # the server's own reason, not a shorter prompt


def test_speed_plan_fits_the_context():
    p = speed.plan(speed.SpeedOptions(), 2048, 400)         # the defaults against the demo's context
    assert p.prompt_tokens == 256 and p.prefill == (2047,) and "2048 -> 2047" in p.notes[0]
    p = speed.plan(speed.SpeedOptions(prompt_tokens=2000, prefill=(512, 2048, 4096)), 2048, 400)
    assert p.prompt_tokens == 1648 and p.prefill == (512, 2047) and len(p.notes) == 2
    p = speed.plan(speed.SpeedOptions(), 420, 400)
    assert p.prompt_tokens is None and "decode not measured: --long 400" in p.notes[0]
    assert speed.plan(speed.SpeedOptions(), None, 400).prefill == (2048,)


def test_long_reply_is_sized_to_the_servers_speed(monkeypatch):
    client, opts = FakeServer().client(), speed.SpeedOptions()
    force = speed.Forcing(client)
    for rate, long in ((10.0, 80), (1.0, 64), (1000.0, 400)):       # 8 s of decoding, within 64-400
        reply = StreamResult("", 32, 5, t_start=0.0, t_first=1.0, t_last=1.0 + 31 / rate)
        monkeypatch.setattr(client, "stream_chat", lambda *a, **k: reply)
        assert speed.long_length(client, force, opts)[0] == long
    assert speed.long_length(client, force, speed.SpeedOptions(long=30)) == (30, [])


def test_needle_and_replay_fit_the_context():
    assert needle.fit_context(needle.NeedleOptions(), 2048) == (2024, [
        "prompts of 2024 tokens, not 4096: the server's context is 2048 tokens and the reply needs 24"])
    assert needle.fit_context(needle.NeedleOptions(context=1024), 2048) == (1024, [])
    assert "does not state" in needle.fit_context(needle.NeedleOptions(), None)[1][0]
    with pytest.raises(ValueError, match="context of 80 tokens leaves no room"):
        needle.fit_context(needle.NeedleOptions(), 80)
    opts, notes = replay.fit_context(replay.ReplayOptions(), 2048)
    assert opts.max_context == 2048 - 2 * 128 and "not 16384" in notes[0]


def test_speed_keeps_what_it_measured_when_a_prefill_is_refused(capsys):
    server = FakeServer(context=2048)
    opts = speed.SpeedOptions(long=24, short=4, prompt_tokens=200, prefill=(256, 4096), concurrency=(1, 2),
                              repeats=1)
    r = speed.run(server.client(), opts)
    assert r["context"] is None and r["forced"] and "does not state" in r["notes"][0]
    assert [d["error"] for d in r["decode"]] == [None, None]
    assert all(d["long_tokens"] == 24 and 196 <= d["prompt_tokens"] <= 200 for d in r["decode"])
    ok, refused = r["prefill"][:2], r["prefill"][2:]
    assert all(p["error"] is None and 250 <= p["prompt_tokens"] <= 256 for p in ok)
    assert len(refused) == 2 and all("maximum context length is 2048" in p["error"] for p in refused)
    decode, prefill, notes = speed.tables(r)
    report.emit("speed", decode, r, None, more=(("prefill", prefill),), notes=notes)
    out = capsys.readouterr().out
    assert "failed" in out and re.search(r"\[1\] 2 requests: .*maximum context length is 2048 tokens", out)
    assert [row.get("failed") for row in prefill] == [None, None, "[1]", "[1]"]


def test_needle_prompts_are_the_length_asked_for_and_failures_are_shown(capsys):
    server = FakeServer(context=2048)
    r = needle.run(server.client(), needle.NeedleOptions(context=1024, depths=(0.0, 0.5, 1.0), trials=3))
    assert r["answered"] == 9 and r["pass_rate"] == 1.0
    assert all(1004 <= i["prompt_tokens"] <= 1024 for i in r["items"])      # within 2%, never over
    r = needle.run(FakeServer(context=700).client(), needle.NeedleOptions(context=1024, depths=(0.5,), trials=2))
    assert r["answered"] == 0 and r["pass_rate"] is None
    rows, notes = needle.rows(r)
    report.emit("needle", rows, r, None, notes=notes)
    out = capsys.readouterr().out
    assert rows[0]["failed"] == "2 [1]" and "[1] 2 requests: " in out and "maximum context length is 700" in out


def test_reasons_group_messages_that_differ_in_numbers_only():
    why = report.Reasons()
    assert why.cell([None, None]) == 0
    assert why.cell(["HTTP 400: prompt of 2071 tokens", None, "HTTP 400: prompt of 2050 tokens"]) == "2 [1]"
    assert why.refs(["timed out", "HTTP 400: prompt of 9 tokens"]) == "[2][1]"
    assert why.lines() == ["[1] 3 requests: HTTP 400: prompt of 2071 tokens", "[2] 1 request: timed out"]
    table = report.table([{"a": 1}, {"a": 2, "failed": "[1]"}])
    assert table.splitlines()[0].split() == ["a", "failed"] and table.splitlines()[2].split() == ["1", "-"]


def test_gsm8k_shows_why_requests_failed(tmp_path, capsys):
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"question": "What is 2 + 2? " * k, "answer": "#### 4"}) + "\n"
                            for k in (1, 30, 40)))
    r = gsm8k.run(FakeServer(context=100).client(), gsm8k.Gsm8kOptions(n=3, data=str(data), concurrency=2))
    assert r["n"] == 3 and r["errors"] == 2 and r["stopped"] is None
    table, notes = gsm8k.rows(r)
    report.emit("GSM8K", table, r, None, notes=notes)
    out = capsys.readouterr().out
    assert table[0]["failed"] == "2 [1]" and "[1] 2 requests: " in out and "maximum context length is 100" in out
    r = gsm8k.run(FakeServer().client(), gsm8k.Gsm8kOptions(n=3, data=str(data)), FakeServer().client())
    assert r["n"] == 3 and r["answer_agreement"] == 1.0 and [i["other"]["reply"] for i in r["items"]] == ["ok"] * 3
