"""Tool choice on the served demo model with ordinary tools (no "strict"), through the official openai client:
forced by name, required among several, nested parameters, no parameters, streamed, and auto. Every call's
arguments must parse and validate against its tool's schema. Greedy decoding, few tokens."""
import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")


def tool(name: str, description: str, parameters: dict | None) -> dict:
    function = {"name": name, "description": description}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = tool("get_weather", "Current weather in a city", {
    "type": "object", "required": ["city", "unit"],
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}})
CLOCK = tool("get_time", "Current time in a time zone", {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]})
HOTEL = tool("book_hotel", "Book a hotel room", {
    "type": "object", "required": ["stay"],
    "properties": {"stay": {"type": "object", "required": ["city", "nights", "guest"], "properties": {
        "city": {"type": "string"}, "nights": {"type": "integer", "minimum": 1, "maximum": 30},
        "guest": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}}})
SOS = tool("call_for_help", "Alert the emergency services", None)
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in (WEATHER, CLOCK, HOTEL, SOS)}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def chat(demo_server):
    client = openai.OpenAI(base_url=demo_server.base_url, api_key=demo_server.api_key, max_retries=0, timeout=300)

    def create(messages, tools, tool_choice, max_tokens=64, **kw):
        return client.chat.completions.create(model=demo_server.model, messages=messages, tools=tools,
                                              tool_choice=tool_choice, max_tokens=max_tokens, temperature=0, **kw)
    return create


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def arguments(call) -> dict:
    """The call's arguments, parsed and validated against its tool's schema (a parameterless tool takes {})."""
    args = json.loads(call.function.arguments)
    schema = SCHEMAS[call.function.name] or {"type": "object", "additionalProperties": False}
    jsonschema.validate(args, schema)
    return args


def test_named_choice_calls_an_ordinary_tool_with_an_enum(chat):
    r = chat(PARIS, [WEATHER, CLOCK], named("get_weather"))
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"], r.choices[0].message
    assert arguments(calls[0])["unit"] in ("celsius", "fahrenheit")
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.content  # OpenAI's for named calls


def test_required_choice_among_several_tools_plain_and_streamed(chat):
    """"required" admits several calls. Served in bf16 on a GPU, the demo may start a second one after the
    first, and a call cut off by max_tokens turns the whole reply into text: room for two calls."""
    tools = [CLOCK, WEATHER, HOTEL]
    r = chat(PARIS, tools, "required", max_tokens=160)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    plain = [(c.function.name, arguments(c)) for c in calls]
    streamed: dict[int, list[str]] = {}
    for chunk in chat(PARIS, tools, "required", max_tokens=160, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name_args = streamed.setdefault(d.index, ["", ""])
            name_args[0] += d.function.name or ""
            name_args[1] += d.function.arguments or ""
    assert [(name, json.loads(args)) for name, args in streamed.values()] == plain


def test_nested_object_parameter(chat):
    messages = [{"role": "user", "content": "Book me, Anna, a hotel in Rome for three nights."}]
    r = chat(messages, [WEATHER, HOTEL], named("book_hotel"), max_tokens=96)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["book_hotel"], r.choices[0].message
    stay = arguments(calls[0])["stay"]
    assert isinstance(stay["guest"]["name"], str) and 1 <= stay["nights"] <= 30


def test_tool_without_parameters_is_called_with_an_empty_object(chat):
    messages = [{"role": "user", "content": "There is a fire in the kitchen!"}]
    for choice in (named("call_for_help"), "required"):
        calls = chat(messages, [SOS], choice, max_tokens=32).choices[0].message.tool_calls
        assert [(c.function.name, arguments(c)) for c in calls] == [("call_for_help", {})]


def test_auto_calls_a_tool_when_the_conversation_asks_for_one(chat):
    """An earlier turn shows the call; the model repeats it for a new city, and the parser returns it."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    messages = PARIS + [{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"sky": "cloudy", "c": 18})},
                        {"role": "assistant", "content": "It is cloudy in Paris, 18 degrees."},
                        {"role": "user", "content": "What is the weather in Rome?"}]
    r = chat(messages, [WEATHER, CLOCK], "auto")
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"], r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and "<tool_call>" not in (r.choices[0].message.content or "")
    arguments(calls[0])


def test_auto_without_a_call_answers_in_text(chat):
    r = chat([{"role": "user", "content": "Say hello."}], [WEATHER], "auto", max_tokens=16)
    message = r.choices[0].message
    assert not message.tool_calls and message.content and "<tool_call>" not in message.content


def test_a_schema_no_value_satisfies_is_a_400_and_the_server_stays_up(chat):
    never = tool("count", "Count", {"type": "object", "required": ["n"],
                                    "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}})
    with pytest.raises(openai.BadRequestError):
        chat(PARIS, [never], "required")
    assert chat(PARIS, [WEATHER], named("get_weather")).choices[0].message.tool_calls
