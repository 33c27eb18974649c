"""Tool calls in vLLM's structural-tag path (vLLM 0.26 to 0.32): two corrections, each applied only where the
vLLM in use still shows the behaviour it corrects.

1. Tools without parameters (0.26 to 0.32). A function declared without `parameters` (or with `{}`) gets a
   grammar that admits any JSON value, so a forced call may come back with arguments `null` or `3`, which
   clients cannot spread into keyword arguments. OpenAI reads a missing parameter list as an empty one, and
   vLLM's own JSON-schema path for tool calls does too; here such a call's arguments are `{}`.
2. Tool schemas no value satisfies (0.26). xgrammar rejects them; vLLM's "auto" backend then falls back to
   llguidance, whose validator cannot read xgrammar's structural tags and raises a KeyError: an HTTP 500. Here
   it is a ValueError carrying xgrammar's reason, which vLLM answers with a 400 (0.32 answers 400 itself).
"""
import importlib
import re
import sys
from types import SimpleNamespace

REGISTRY = "vllm.tool_parsers.structural_tag_registry"
NAMES = ("get_function_parameters", "_get_function_parameters")  # 0.32's name; 0.26's
USERS = ("vllm.parser.harmony",)  # modules that imported the function by name (0.32)
PARSERS = "vllm.tool_parsers.abstract_tool_parser"  # loaded at start where tool grammars are built: the server
GUIDANCE = "vllm.v1.structured_output.backend_guidance"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
XGRAMMAR_TAG = '{"type": "structural_tag", "format": {"type": "any_text"}}'


def no_parameters_as_empty_object(original):
    """Wrap vLLM's `get_function_parameters(function)` (the schema a call's arguments are held to)."""
    def get_function_parameters(function):
        schema = original(function)
        if schema is True and getattr(function, "strict", None) is not False and not function.parameters:
            return dict(NO_PARAMETERS)
        return schema

    get_function_parameters.xmoe_patched = True
    return get_function_parameters


def _server_module(name: str):
    """`name` if loaded; in the OpenAI server's process (the one that has loaded vLLM's tool parsers) imported
    now, as 0.26 imports the registry only at the first request with tools. Other processes skip it."""
    if name not in sys.modules and PARSERS in sys.modules:
        try:
            importlib.import_module(name)
        except ImportError:
            return None
    return sys.modules.get(name)


def patch_tool_arguments() -> bool:
    """Patch the registry and llguidance's validator where needed; True if either was patched now."""
    return any([_patch_parameterless(), _patch_guidance_validation()])


def _patch_parameterless() -> bool:
    registry = _server_module(REGISTRY)
    name = next((n for n in NAMES if hasattr(registry, n)), None)
    original = getattr(registry, name, None) if name else None
    if original is None or getattr(original, "xmoe_patched", False):
        return False
    if original(SimpleNamespace(strict=True, parameters=None)) is not True:
        return False  # this vLLM already constrains a parameterless call
    patched = no_parameters_as_empty_object(original)
    for module_name in (REGISTRY, *USERS):
        module = sys.modules.get(module_name)
        if getattr(module, name, None) is original:
            setattr(module, name, patched)
    return True


def xgrammar_reason(sampling_params) -> str | None:
    """Why xgrammar rejects the request's grammar, without its log prefix ("[time] file.cc:line: ")."""
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar
    try:
        validate_xgrammar_grammar(sampling_params)
    except Exception as e:  # a ValueError on 0.26, VLLMValidationError (no ValueError) later
        return re.sub(r"^\[[\d:.]+\] \S+:\d+: ", "", str(e.__cause__ or e).strip())
    return None


def errors_as_bad_requests(original):
    """Wrap `validate_guidance_grammar(sampling_params, tokenizer)`: any error it raises becomes a ValueError."""
    def validate_guidance_grammar(sampling_params, tokenizer=None):
        try:
            return original(sampling_params, tokenizer=tokenizer)
        except ValueError:
            raise
        except Exception as e:
            reason = xgrammar_reason(sampling_params) or f"{type(e).__name__}: {e}"
            raise ValueError(f"Invalid structured output or tool schema: {reason}") from e

    validate_guidance_grammar.xmoe_patched = True
    validate_guidance_grammar.__wrapped__ = original
    return validate_guidance_grammar


def _patch_guidance_validation() -> bool:
    guidance = _server_module(GUIDANCE)
    original = getattr(guidance, "validate_guidance_grammar", None)
    if original is None or getattr(original, "xmoe_patched", False):
        return False
    from vllm.sampling_params import StructuredOutputsParams
    try:
        original(SimpleNamespace(structured_outputs=StructuredOutputsParams(structural_tag=XGRAMMAR_TAG)))
    except KeyError:
        guidance.validate_guidance_grammar = errors_as_bad_requests(original)  # sampling_params imports it per call
        return True
    except Exception:
        pass
    return False  # this vLLM reads the tag or rejects it as a bad request
