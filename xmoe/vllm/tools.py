"""Tool calls without parameters, in vLLM's structural-tag path (checked against vLLM 0.32).

There, a function declared without `parameters` (or with `{}`) gets a grammar that admits any JSON value, so a
forced call may come back with arguments `null` or `3`, which clients cannot spread into keyword arguments.
OpenAI reads a missing parameter list as an empty one, and vLLM's own JSON-schema path for tool calls does too;
this makes the structural-tag path agree: such a call's arguments are `{}`. The patch checks for the behaviour
it corrects first, so it does nothing on a vLLM that no longer has it.
"""
import sys
from types import SimpleNamespace

REGISTRY = "vllm.tool_parsers.structural_tag_registry"
USERS = ("vllm.parser.harmony",)  # modules that imported the function by name
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def no_parameters_as_empty_object(original):
    """Wrap vLLM's `get_function_parameters(function)` (the schema a call's arguments are held to)."""
    def get_function_parameters(function):
        schema = original(function)
        if schema is True and getattr(function, "strict", None) is not False and not function.parameters:
            return dict(NO_PARAMETERS)
        return schema

    get_function_parameters.xmoe_patched = True
    return get_function_parameters


def patch_tool_arguments() -> bool:
    """Patch the loaded registry; True if patched now. Only where vLLM has loaded it already (its OpenAI server
    imports it at start): engine and worker processes never build tool grammars and skip the import."""
    registry = sys.modules.get(REGISTRY)
    original = getattr(registry, "get_function_parameters", None)
    if original is None or getattr(original, "xmoe_patched", False):
        return False
    if original(SimpleNamespace(strict=True, parameters=None)) is not True:
        return False  # this vLLM already constrains a parameterless call
    patched = no_parameters_as_empty_object(original)
    for name in (REGISTRY, *USERS):
        module = sys.modules.get(name)
        if getattr(module, "get_function_parameters", None) is original:
            module.get_function_parameters = patched
    return True
