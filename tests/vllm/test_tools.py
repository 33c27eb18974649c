"""The plugin's fix for calls of tools without parameters, on vLLM's own structural-tag builder (no server)."""
import importlib
import json
import sys
from types import SimpleNamespace

from xmoe.vllm.tools import NO_PARAMETERS, REGISTRY, USERS, no_parameters_as_empty_object, patch_tool_arguments

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
