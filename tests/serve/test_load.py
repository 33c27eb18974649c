"""32 concurrent streaming clients against the shared demo server for a bounded time: no errors."""
from xmoe.serve.load import LoadOptions, run_load


def test_32_streaming_clients_without_errors(demo_server):
    report = run_load(demo_server.base_url, demo_server.api_key, demo_server.model,
                      LoadOptions(clients=32, seconds=5, max_tokens=12))
    s = report.summary()
    print(s)
    assert report.errors == []
    assert s["requests"] >= 32 and s["output_tokens"] >= 32  # every client finished at least one request
    assert s["latency_p95_s"] >= s["latency_p50_s"] > 0
    assert demo_server.alive()


def _chunk(content=None, finish=None, usage=None):
    from types import SimpleNamespace as NS
    choices = [] if content is None and finish is None else [NS(delta=NS(content=content), finish_reason=finish)]
    return NS(choices=choices, usage=usage)


def _answer(*chunks):
    """One _one() call against a client that streams `chunks`: (the report, the error raised or None)."""
    import asyncio
    from types import SimpleNamespace as NS

    from xmoe.serve.load import LoadReport, _one

    async def stream():
        for c in chunks:
            yield c

    async def create(**kwargs):
        return stream()

    report = LoadReport(1)
    try:
        asyncio.run(_one(NS(chat=NS(completions=NS(create=create))), "m", "hi", LoadOptions(), report))
    except RuntimeError as e:
        return report, str(e)
    return report, None


def test_an_answer_ended_by_its_first_token_is_valid_but_a_cut_stream_is_not():
    from types import SimpleNamespace as NS
    usage = NS(completion_tokens=1, prompt_tokens=5)
    report, error = _answer(_chunk("", "stop"), _chunk(usage=usage))  # end-of-text sampled first
    assert error is None and report.requests == 1 and report.empty == 1 and report.ttfts == []
    report, error = _answer(_chunk("Paris"), _chunk(finish="stop"), _chunk(usage=usage))
    assert error is None and report.empty == 0 and len(report.ttfts) == 1
    assert "finish reason" in _answer(_chunk("Par"), _chunk(usage=usage))[1]  # no finish: cut short
    assert "usage" in _answer(_chunk("Paris", "stop"))[1]
    long_usage = NS(completion_tokens=48, prompt_tokens=5)
    assert "no text in 48 tokens" in _answer(_chunk("", "length"), _chunk(usage=long_usage))[1]
