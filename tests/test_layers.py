"""The shape of the code, as the file list should show it: the engine at the bottom imports nothing from
the edges, no module is past 500 lines, and the imports between ggufspec's modules form no circle
(lazy imports inside functions included)."""
import ast
from pathlib import Path

import ggufspec

PACKAGE = Path(ggufspec.__file__).parent
# native -> sampling/drafting -> speculate, with what they need to load models and keep costs
ENGINE = {"errors", "gguffiles", "ggufheader", "backends", "native", "lora", "placement", "bridge", "sampling", "processing", "thinking", "grammar", "dry", "mirostat", "adaptivep", "checks", "costmodel", "costs", "drafting", "ngram", "mtp", "simulate", "stats",
          "speculate", "generation", "stepcosts", "load", "home", "costmemory", "lockstep", "slots", "llamalog", "chat_templates", "stops"}
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """ggufspec modules `path` imports (top-level names: 'plan' for ggufspec.plan.devices)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            target = base + (node.module.split(".") if node.module else [])
            names = [target] if node.module else [target + [alias.name] for alias in node.names]
            found.update(name[0] for name in names if name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ggufspec."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("ggufspec."))
    return found


def graph() -> dict[str, set[str]]:
    """Top-level module (or subpackage) -> the top-level modules it imports, itself excluded."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        top = module_name(path).split(".")[0] or "__init__"
        edges.setdefault(top, set()).update(imported_modules(path) - {top})
    return edges


def test_the_engine_imports_nothing_from_the_edges():
    edges = graph()
    for module in ENGINE:
        assert edges.get(module, set()) <= ENGINE, (module, edges[module] - ENGINE)


def test_no_module_is_past_500_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long


def test_no_circles_between_modules():
    edges = {m: e - {"__init__"} for m, e in graph().items() if m != "__init__"}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for nxt in sorted(edges.get(module, ())):
            assert state.get(nxt) != "open", " -> ".join(path + [module, nxt])
            if nxt not in state:
                visit(nxt, path + [module])
        state[module] = "done"
    for module in sorted(edges):
        if module not in state:
            visit(module, [])
