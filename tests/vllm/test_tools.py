"""The plugin's tool-call corrections (no server): calls of tools without parameters, on vLLM's own structural-tag
builder, and tool schemas no value satisfies, as bad requests."""
import importlib
import json
import sys
from types import SimpleNamespace

import pytest

from xmoe.vllm.tools import (GUIDANCE, NO_PARAMETERS, REGISTRY, USERS, XGRAMMAR_TAG, errors_as_bad_requests,
                             no_parameters_as_empty_object, patch_tool_arguments)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_only_parameterless_strict_functions_change():
    def vllm_0_32(function):  # vLLM 0.32's rule: non-strict or parameterless -> any JSON
        return True if function.strict is False or function.parameters is None else function.parameters
    patched = no_parameters_as_empty_object(vllm_0_32)
    assert patched(SimpleNamespace(strict=True, parameters=None)) == NO_PARAMETERS
    assert patched(SimpleNamespace(strict=None, parameters=None)) == NO_PARAMETERS
    assert patched(SimpleNamespace(strict=True, parameters=WEATHER)) is WEATHER
    assert patched(SimpleNamespace(strict=False, parameters=WEATHER)) is True  # vLLM's choice for free arguments
    assert patched(SimpleNamespace(strict=False, parameters=None)) is True


def _schemas(registry, tools, tool_choice, level):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                    tool_choice=tool_choice)
    tag = registry.get_model_structural_tag("hermes", request.tools, request.tool_choice, False,
                                            strict_level=ToolStrictLevel[level])
    return [t["content"]["json_schema"] for t in json.loads(tag.model_dump_json())["format"]["tags"]]


def test_patch_on_vllms_registry(monkeypatch):
    registry = importlib.import_module(REGISTRY)
    for name in (REGISTRY, *USERS):  # monkeypatch puts vLLM's function back afterwards
        if hasattr(sys.modules.get(name), "get_function_parameters"):
            monkeypatch.setattr(sys.modules[name], "get_function_parameters", registry.get_function_parameters)
    sos = {"type": "function", "function": {"name": "call_for_help"}}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    before = _schemas(registry, [sos], "required", "PARAMETER")
    patched = patch_tool_arguments()
    assert patched == (before == [True, True])  # patched exactly when this vLLM leaves the arguments free
    assert _schemas(registry, [sos], "required", "PARAMETER") == [NO_PARAMETERS] * 2
    assert _schemas(registry, [weather], "required", "PARAMETER") == [WEATHER] * 2
    assert _schemas(registry, [weather], "required", "AUTO") == [True] * 2  # the level, not the patch, holds these
    assert not patch_tool_arguments()  # idempotent


def test_guidance_errors_become_bad_requests_with_xgrammars_reason():
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    never = {"type": "integer", "minimum": 5, "maximum": 1}
    tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "separator": "", "at_least_one": True,
           "tags": [{"type": "tag", "begin": "<t>", "content": {"type": "json_schema", "json_schema": never},
                     "end": "</t>"}]}}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(tag)))

    def vllm_0_26(sampling_params, tokenizer=None):  # llguidance's validator on an xgrammar structural tag
        raise KeyError("triggers")

    def rejects(sampling_params, tokenizer=None):
        raise ValueError("Grammar error: x")
    with pytest.raises(ValueError, match="minimum greater than maximum"):
        errors_as_bad_requests(vllm_0_26)(params)
    with pytest.raises(ValueError, match="Grammar error: x"):  # already a bad request: as it was
        errors_as_bad_requests(rejects)(params)


def test_guidance_validator_patched_exactly_where_it_cannot_read_structural_tags(monkeypatch):
    from vllm.sampling_params import StructuredOutputsParams
    guidance = importlib.import_module(GUIDANCE)
    original = getattr(guidance.validate_guidance_grammar, "__wrapped__", guidance.validate_guidance_grammar)
    monkeypatch.setattr(guidance, "validate_guidance_grammar", original)  # put back afterwards
    try:
        original(SimpleNamespace(structured_outputs=StructuredOutputsParams(structural_tag=XGRAMMAR_TAG)))
        fails = False
    except Exception as e:
        fails = isinstance(e, KeyError)  # 0.26; 0.32 answers a bad request itself
    patch_tool_arguments()
    assert (guidance.validate_guidance_grammar is not original) == fails
