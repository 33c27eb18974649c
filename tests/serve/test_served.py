"""The demo model served by vLLM through `xmoe serve`'s launcher, spoken to with the official openai client.
One server for the session (the `demo_server` fixture in tests/conftest.py)."""
import json
import sys
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
from reference import exl3_tensors, set_decoded  # noqa: E402

from xmoe.format import decode_weight  # noqa: E402
from xmoe.serve.demo import demo_reference  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.base_url, api_key=demo_server.api_key, max_retries=0, timeout=300)


def test_models_lists_the_served_model(client, demo_server):
    assert [m.id for m in client.models.list().data] == [demo_server.model]


def test_chat_completion_answers(client, demo_server):
    r = client.chat.completions.create(model=demo_server.model, messages=FRANCE, max_tokens=16, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert r.usage.completion_tokens <= 16 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_request_without_sampling_settings_ends_in_bounded_length(client, demo_server):
    """A client that sets nothing (the README's first request, less its max_tokens) gets the model's own
    sampling defaults and a reply of bounded length that ends with a finish reason."""
    from xmoe.serve.upcycle import REPLY_TOKENS
    r = client.chat.completions.create(model=demo_server.model, messages=FRANCE)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content.strip()
    assert 0 < r.usage.completion_tokens <= REPLY_TOKENS
    assert (choice.finish_reason == "length") == (r.usage.completion_tokens == REPLY_TOKENS)


def test_ready_line_names_the_url_and_a_request_that_works(demo_server):
    """The line printed once the server answers, and its curl request, sent as written (with $API_KEY)."""
    import shlex

    import httpx
    log = demo_server.log_path.read_text()
    assert f"xmoe serve: ready at {demo_server.base_url} " in log
    line = next(ln for ln in log.splitlines() if ln.strip().startswith("curl "))
    argv = shlex.split(line.replace("$API_KEY", demo_server.api_key))
    headers = dict(h.split(": ", 1) for flag, h in zip(argv, argv[1:]) if flag == "-H")
    body = json.loads(argv[argv.index("-d") + 1])
    assert body["max_tokens"] <= 64 and body["model"] == demo_server.model
    r = httpx.post(argv[1], headers=headers, content=argv[argv.index("-d") + 1], timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].strip()


def test_streaming_with_usage_matches_the_plain_answer(client, demo_server):
    args = dict(model=demo_server.model, messages=FRANCE, max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_tool_call_round_trip(client, demo_server):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=demo_server.model, messages=messages, tools=[WEATHER], max_tokens=64,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       temperature=0)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    arguments = json.loads(calls[0].function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    messages += [{"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
                 {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"sky": "cloudy", "c": 18})}]
    reply = client.chat.completions.create(model=demo_server.model, messages=messages, tools=[WEATHER],
                                           tool_choice="none", max_tokens=24, temperature=0)
    assert reply.choices[0].message.content.strip()
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > r.usage.prompt_tokens  # the tool result went into the prompt


def test_greedy_tokens_equal_transformers_on_the_decoded_weights(client, demo_server):
    """vLLM (Mixtral path + xmoe's EXL3 experts) against transformers on the weights the pack decodes to."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    reference = demo_reference()
    tok = AutoTokenizer.from_pretrained(reference)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"]
               for q in ("Name a fruit.", "What does a cat say?")]
    n = 8
    served = []
    for p in prompts:
        r = client.completions.create(model=demo_server.model, prompt=p, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True, "min_tokens": n, "return_token_ids": True})
        served.append(r.choices[0].model_dump()["token_ids"])
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    exl3 = exl3_tensors(demo_server.options.model)
    assert exl3, "the test variant must hold EXL3 experts"
    for key, t in exl3.items():
        set_decoded(model, key.replace(".block_sparse_moe.", ".mlp."), decode_weight(t))
    for p, got in zip(prompts, served):
        ids = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert got == ids[0, len(p):].tolist()
