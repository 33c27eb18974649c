"""Scoring with hand-made inputs: GSM8K answers, BFCL tool calls, the needle's placement, Prometheus counters."""

import pytest

from xmoe.bench import gsm8k, metrics, needle, toolcall


@pytest.mark.parametrize("reply,answer", [
    ("She has 9 eggs, 9 * 2 = 18.\n#### 18", "18"),
    ("#### $1,234", "1234"),
    ("so the total is 3.50 dollars\n#### 3.5", "3.5"),
    ("#### -7.0", "-7"),
    ("First 4, then 12. The answer is 20.", "20"),   # no marker: the last number
    ("#### 5\nwait, #### 6", "6"),                    # the last marker wins
    ("I do not know.", None),
])
def test_gsm8k_extract(reply, answer):
    assert gsm8k.extract(reply) == answer


def test_gsm8k_known_answers_score(tmp_path):
    truth = [gsm8k.extract("... #### 18"), gsm8k.extract("#### 3"), gsm8k.extract("#### 70000")]
    assert truth == ["18", "3", "70000"]
    got = [{"reply": "#### 18", "answer": "18", "error": None},
           {"reply": "#### 4", "answer": "4", "error": None},
           {"reply": None, "answer": None, "error": "HTTP 500"}]
    s = gsm8k.score(truth, got)
    assert s == {"correct": 1, "accuracy": pytest.approx(1 / 3), "no_answer": 0, "errors": 1}
    other = [{"reply": "#### 18", "answer": "18", "error": None},
             {"reply": "it is 4", "answer": "4", "error": None},
             {"reply": "#### 1", "answer": "1", "error": None}]
    a = gsm8k.agreement(got, other)
    assert a == {"answer_agreement": pytest.approx(2 / 3), "text_agreement": pytest.approx(1 / 3)}


def test_gsm8k_data_file_answers_parse(gsm8k_path):
    rows = gsm8k.gsm8k(str(gsm8k_path))
    assert len(rows) == 1319 and all(gsm8k.extract(r["answer"]) is not None for r in rows)


FUNCS = [{"name": "math.hypot", "description": "d", "parameters": {"type": "dict", "properties": {
    "x": {"type": "integer"}, "y": {"type": "integer"}, "z": {"type": "float", "description": "optional"},
    "opts": {"type": "dict", "properties": {"unit": {"type": "string"}}},
    "pts": {"type": "tuple", "items": {"type": "any"}}}, "required": ["x", "y"]}}]
TRUTH = [{"math.hypot": {"x": [3], "y": [4], "z": ["", 0.0], "opts": ["", {"unit": ["cm", "centimeter"]}]}}]


def test_bfcl_schema_is_json_schema():
    (tool,) = toolcall.tools(FUNCS)
    assert tool["function"]["name"] == "math_hypot"
    params = tool["function"]["parameters"]
    assert params["type"] == "object" and params["properties"]["z"]["type"] == "number"
    assert params["properties"]["opts"]["type"] == "object"
    assert params["properties"]["pts"]["type"] == "array" and "type" not in params["properties"]["pts"]["items"]


@pytest.mark.parametrize("calls,why", [
    ([("math_hypot", {"x": 3, "y": 4})], None),                                   # optional ones omitted
    ([("math.hypot", {"x": 3, "y": 4, "z": 0})], None),                           # int accepted for a float
    ([("math_hypot", {"x": 3, "y": 4, "opts": {"unit": "CM"}})], None),           # strings ignore case
    ([("math_hypot", {"x": 3, "y": 5})], "wrong value for 'y'"),
    ([("math_hypot", {"x": 3.0, "y": 4})], "wrong value for 'x'"),                # float where int expected
    ([("math_hypot", {"x": 3})], "missing argument 'y'"),
    ([("math_hypot", {"x": 3, "y": 4, "w": 1})], "unexpected argument 'w'"),
    ([("math_hypot", {"x": 3, "y": 4, "opts": {"unit": "m"}})], "wrong value for 'opts'"),
    ([("hypot", {"x": 3, "y": 4})], "called 'hypot'"),
    ([], "0 calls, expected 1"),
    ([("math_hypot", {"x": 3, "y": 4})] * 2, "2 calls, expected 1"),
    ([("math_hypot", {"x": True, "y": 4})], "wrong value for 'x'"),               # bool is not an int
])
def test_toolcall_scoring_hand_made(calls, why):
    got = toolcall.check_calls(calls, TRUTH)
    assert (got is None) if why is None else (got is not None and got.startswith(why)), got


def test_toolcall_parse_calls():
    msg = {"tool_calls": [{"function": {"name": "math_hypot", "arguments": '{"x": 3, "y": 4}'}}]}
    assert toolcall.parse_calls(msg) == [("math_hypot", {"x": 3, "y": 4})]
    assert toolcall.parse_calls({"content": "no"}) == []
    with pytest.raises(ValueError, match="not JSON"):
        toolcall.parse_calls({"tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]})


def first_choice(allowed: dict) -> dict:
    """A call BFCL accepts: the first allowed value of each argument, dicts nested in values likewise."""
    return {k: pick(v[0]) for k, v in allowed.items() if v[0] != ""}


def pick(value):
    if isinstance(value, dict):
        return first_choice(value)
    return [pick(v) for v in value] if isinstance(value, list) else value


def test_toolcall_real_bfcl_items_score_their_own_answers():
    items = {c: toolcall.bfcl_items(c) for c in toolcall.CATEGORIES}
    assert len(items["simple_python"]) == 400 and len(items["multiple"]) == 200
    for it in items["simple_python"] + items["multiple"]:
        (name, allowed), = it["ground_truth"][0].items()
        right = first_choice(allowed)
        assert toolcall.check_calls([(name, right)], it["ground_truth"]) is None, it["id"]
        assert toolcall.check_calls([(name + "x", right)], it["ground_truth"]) is not None
        assert toolcall.tools(it["function"])  # every schema converts


def test_needle_placement():
    text = "".join(f"Sentence number {i}. " for i in range(200))
    for depth in (0.0, 0.5, 1.0):
        hay = needle.hide(text, 37, 2000, depth, "The secret code is 123.")
        at = hay.index("The secret code is 123.") / len(hay)
        assert abs(at - depth) < 0.05 and len(hay) < 2000 + 30
        before = hay[: hay.index("The secret")].rstrip()
        assert depth == 0.0 or before.endswith(".")                  # placed at a sentence end
    assert len(needle.hide("abc. ", 0, 50, 0.5, "N.")) > 40           # a short text wraps around


PAGE = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
vllm:num_preemptions_total{engine="0",model_name="m"} 0.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 500.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
"""


def test_metrics_parse_and_delta():
    before = metrics.parse(PAGE)
    assert before[metrics.PROMPT_TOKENS] == 1500.0 and before["vllm:kv_cache_usage_perc"] == 0.5
    after = metrics.parse(PAGE.replace("1000.0", "3000.0").replace("250.0", "1750.0"))
    d = metrics.delta(before, after)
    assert d[metrics.PREFIX_QUERIES] == 2000 and d[metrics.PREFIX_HITS] == 1500
    assert metrics.prefix_hit_share(d) == 0.75
    assert d[metrics.GENERATION_TOKENS] is None                     # not exported: None, not 0
    assert metrics.prefix_hit_share(metrics.delta({}, {})) is None
