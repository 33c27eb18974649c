"""xmoe/bench is a client of servers and of the pack format: it imports nothing else of xmoe."""
import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "xmoe" / "bench"


def test_bench_imports_only_itself_and_format():
    for path in BENCH.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                top = (node.module or "").split(".")[0]
                assert node.level == 1 or top == "format", f"{path.name}: from {'.' * node.level}{node.module}"
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                assert not any(n.startswith("xmoe.") and not n.startswith(("xmoe.bench", "xmoe.format"))
                               for n in names), f"{path.name}: {names}"
