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
