"""Which part of xmoe may import which (imports one way): each stage folder imports itself and the modules listed
here, nothing else of xmoe. A stage named whole may be imported anywhere; a module named alone is the one way in
(the kernels' public surface is kernels.ops; quant reads the kernels' codebook only)."""
import ast
from pathlib import Path

import xmoe

ROOT = Path(xmoe.__file__).parent
ALLOWED = {
    "format": set(),
    "kernels": {"format"},
    "quant": {"format", "kernels.triton_codebook"},
    "vllm": {"format", "kernels.ops"},
    "serve": {"format", "quant", "kernels.ops", "vllm"},
    "bench": {"format"},
}


def imported(path: Path, stage: str) -> set[str]:
    """The xmoe modules a file imports, as dotted names under xmoe ("kernels.ops"; "" for the package itself)."""
    package = ["xmoe", *path.relative_to(ROOT).parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            names.update(".".join(base[1:] + ([a.name] if not node.module else [])) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xmoe"):
            names.add(node.module.removeprefix("xmoe").lstrip("."))
        elif isinstance(node, ast.Import):
            names.update(a.name.removeprefix("xmoe").lstrip(".") for a in node.names if a.name.startswith("xmoe"))
    return names


def allowed(name: str, stage: str) -> bool:
    if name in ("", "__version__") or name.split(".")[0] == stage:
        return True
    return any(name == rule or name.startswith(rule + ".") and "." not in rule for rule in ALLOWED[stage])


def test_imports_go_one_way():
    for stage in ALLOWED:
        for path in (ROOT / stage).rglob("*.py"):
            for name in imported(path, stage):
                assert allowed(name, stage), f"{path.relative_to(ROOT)} imports xmoe.{name}"


def test_the_rules_bite():
    kernels = ROOT / "kernels" / "ops.py"
    assert "kernels.plan" in imported(kernels, "kernels") and "format.hadamard" in imported(ROOT / "kernels" /
                                                                                               "launch.py", "kernels")
    assert not allowed("kernels.plan", "vllm") and not allowed("kernels.triton_gemm", "quant")
    assert allowed("kernels.ops", "vllm") and allowed("format.layer", "vllm") and not allowed("quant.plan", "vllm")
