"""Every `xmoe bench` tool, briefly, against the demo server (one server for the session), through the CLI
as a user runs it: the numbers must be sane and no request may fail."""
import json
import pytest

from xmoe.cli import main


def bench(server, tmp_path, tool: str, *args: str) -> dict:
    out = tmp_path / f"{tool}.json"
    rc = main(["bench", tool, "--url", server.base_url, f"--api-key={server.api_key or ''}", "--model", server.model,
               "--json", str(out), *args])
    assert rc == 0
    return json.loads(out.read_text())


def test_speed(demo_server, tmp_path):
    r = bench(demo_server, tmp_path, "speed", "--long", "24", "--short", "4", "--prompt-tokens", "64",
              "--prefill", "256", "--concurrency", "1", "2", "--repeats", "1", "--plot", str(tmp_path / "s.png"))
    assert r["forced"] is True                                   # vLLM honours min_tokens / ignore_eos
    for d in r["decode"]:
        assert d["short_tokens"] == 4 and d["long_tokens"] == 24
        assert d["long_s"] > d["short_s"] > 0 and 0 < d["stream_tok_s"] < 10_000
        assert d["aggregate_tok_s"] == pytest.approx(d["stream_tok_s"] * d["streams"])
    assert [p["streams"] for p in r["prefill"]] == [1, 2]
    assert all(200 <= p["prompt_tokens"] <= 300 and p["prefill_tok_s"] > 0 for p in r["prefill"])
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_needle_found_at_short_context(demo_server, tmp_path):
    r = bench(demo_server, tmp_path, "needle", "--context", "192", "--depths", "0", "0.5", "--trials", "2")
    assert [d["depth"] for d in r["depths"]] == [0.0, 0.5] and all(d["errors"] == 0 for d in r["depths"])
    assert all(abs(i["prompt_tokens"] - 192) <= 24 for i in r["items"])
    assert all(i["passed"] == (i["code"] in i["reply"]) for i in r["items"])
    assert r["pass_rate"] > 0, [i["reply"] for i in r["items"]]


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
