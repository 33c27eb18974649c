"""Every `xmoe bench` tool, briefly, against the demo server (one server for the session), through the CLI
as a user runs it: the numbers must be sane and no request may fail but those a test makes fail."""
import json
import re

import pytest

from xmoe.bench.client import Client
from xmoe.cli import main


def bench(server, tmp_path, tool: str, *args: str) -> dict:
    out = tmp_path / f"{tool}.json"
    rc = main(["bench", tool, "--url", server.base_url, f"--api-key={server.api_key or ''}", "--model", server.model,
               "--json", str(out), *args])
    assert rc == 0
    return json.loads(out.read_text())


def test_speed(demo_server, tmp_path, monkeypatch, capsys):
    """A server that does not state its context (as if): the prefill it refuses keeps its row, with vLLM's
    reason under the table, and every other step is measured."""
    monkeypatch.setattr(Client, "context_length", lambda self: None)
    r = bench(demo_server, tmp_path, "speed", "--long", "24", "--short", "4", "--prompt-tokens", "64",
              "--prefill", "256", "4096", "--concurrency", "1", "2", "--repeats", "1",
              "--plot", str(tmp_path / "s.png"))
    assert r["forced"] is True                                   # vLLM honours min_tokens / ignore_eos
    for d in r["decode"]:
        assert d["short_tokens"] == 4 and d["long_tokens"] == 24 and 62 <= d["prompt_tokens"] <= 64
        assert d["long_s"] > d["short_s"] > 0 and 0 < d["stream_tok_s"] < 10_000
        assert d["aggregate_tok_s"] == pytest.approx(d["stream_tok_s"] * d["streams"])
    ok, refused = r["prefill"][:2], r["prefill"][2:]
    assert [p["streams"] for p in ok] == [1, 2] and [p["streams"] for p in refused] == [1, 2]
    assert all(251 <= p["prompt_tokens"] <= 256 and p["prefill_tok_s"] > 0 and not p["error"] for p in ok)
    assert all("HTTP 400" in p["error"] and "maximum context length is 2048" in p["error"] for p in refused)
    out = capsys.readouterr().out
    assert re.search(r"\[1\] 2 requests: .*HTTP 400: .*maximum context length is 2048 tokens", out)
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_speed_fits_the_servers_context(demo_server, tmp_path):
    """The default prefill length, 2048, against the demo's 2048-token context: cut to the longest prompt
    the server takes, within 1% of it."""
    r = bench(demo_server, tmp_path, "speed", "--long", "8", "--short", "4", "--prompt-tokens", "64",
              "--prefill", "2048", "--concurrency", "1", "--repeats", "1")
    assert r["context"] == 2048 and r["counted_by"] == "/tokenize"
    assert any("prefill 2048 -> 2047 tokens" in n for n in r["notes"])
    (p,) = r["prefill"]
    assert p["error"] is None and p["target_tokens"] == 2047 and 2026 <= p["prompt_tokens"] <= 2047
    assert r["decode"][0]["error"] is None and r["decode"][0]["stream_tok_s"] > 0


def test_needle_found_at_short_context(demo_server, tmp_path):
    r = bench(demo_server, tmp_path, "needle", "--context", "192", "--depths", "0", "0.5", "--trials", "2")
    assert [d["depth"] for d in r["depths"]] == [0.0, 0.5] and all(d["errors"] == 0 for d in r["depths"])
    assert all(188 <= i["prompt_tokens"] <= 192 for i in r["items"])      # the server's count, within 2%
    assert all(i["passed"] == (i["code"] in i["reply"]) for i in r["items"])
    assert r["pass_rate"] > 0, [i["reply"] for i in r["items"]]


def test_needle_fits_the_servers_context(demo_server, tmp_path):
    """--context 2048 against the demo's 2048-token context: prompts cut to leave room for the reply."""
    r = bench(demo_server, tmp_path, "needle", "--context", "2048", "--depths", "0.5", "--trials", "1",
              "--max-tokens", "12")
    assert r["context"] == 2036 and r["answered"] == 1 and "the server's context is 2048 tokens" in r["notes"][0]
    assert 1996 <= r["items"][0]["prompt_tokens"] <= 2036


def test_toolcall(demo_server, tmp_path):
    r = bench(demo_server, tmp_path, "toolcall", "--n", "1", "--max-tokens", "32")
    assert [c["category"] for c in r["categories"]] == ["simple_python", "multiple"]
    for c in r["categories"]:
        assert c["n"] == 1 and c["errors"] == 0 and 0 <= c["accuracy"] <= 1
        for it in c["items"]:               # the score is the scorer's verdict on what the server returned
            assert isinstance(it["calls"], list) and it["passed"] == (it["reason"] is None)


def test_gsm8k_with_agreement(demo_server, tmp_path, gsm8k_path):
    r = bench(demo_server, tmp_path, "gsm8k", "--n", "2", "--max-tokens", "48", "--concurrency", "1",
              "--data", str(gsm8k_path), "--other-url", demo_server.base_url)
    assert r["n"] == 2 and r["errors"] == 0 and 0 <= r["accuracy"] <= 1
    assert [i["truth"] for i in r["items"]] == ["18", "3"]      # the first two answers of the test set
    # the same greedy server twice, one request at a time: the same replies
    assert r["answer_agreement"] == 1.0 and r["text_agreement"] == 1.0


def test_humaneval(demo_server, tmp_path):
    r = bench(demo_server, tmp_path, "humaneval", "--n", "2", "--max-tokens", "64", "--timeout-per-problem", "5")
    assert r["n"] == 2 and 0 <= r["pass@1"] <= 1 and "request error" not in r["statuses"]
    assert sum(r["statuses"].values()) == 2 and all(i["completion"] for i in r["items"])


def test_replay(demo_server, tmp_path):
    r = bench(demo_server, tmp_path, "replay", "--duration", "6", "--sessions", "2", "--max-tokens", "12",
              "--tool-chars", "400", "--system-chars", "1500", "--max-context", "1200")
    assert r["errors"] == 0 and r["requests"] >= 2
    assert r["prompt_tokens"] > 0 and r["completion_tokens"] > 0 and r["aggregate_tok_s"] > 0
    assert r["preemptions"] == 0
    assert 0 < r["prefix_hit_share"] <= 1                       # turns repeat their history: some hits


def test_wrong_api_key_is_a_clear_error(demo_server, capsys):
    assert demo_server.api_key
    assert main(["bench", "needle", "--url", demo_server.base_url, "--api-key", "wrong"]) == 2
    assert "HTTP 401" in capsys.readouterr().err


def test_eval_quality_through_servers(demo_server, tmp_path):
    """The server route of `xmoe eval quality`, with the same server on both sides: KL 0, equal perplexity."""
    out = tmp_path / "q.json"
    url = demo_server.base_url
    assert main(["eval", "quality", url, "--reference", url, f"--api-key={demo_server.api_key}", "--tokens", "200",
                 "--top-k", "5", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokens_scored"] >= 200 and 0 < r["kl_coverage"] <= 1
    assert r["kl_mean"] == pytest.approx(0, abs=1e-6) and r["top1_agreement"] == 1.0
    assert r["ppl"] == pytest.approx(r["ppl_reference"]) and 1 < r["ppl"] < 1000
