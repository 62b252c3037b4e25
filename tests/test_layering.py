"""The package's shape, read from its source (no imports, no Ray): nothing in the core imports the
tools, the module import graph has no circle, and no file or function grows past what a reader
takes in at once."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ray_reshard"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 120


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


def imports(path: Path) -> set[str]:
    """Modules of ours that `path` imports, anywhere in it (inside functions and for type
    checking too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("ray_reshard"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[:len(package.split(".")) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if not target.startswith("ray_reshard"):
                    continue
                subs = [f"{target}.{a.name}" for a in child.names if f"{target}.{a.name}" in MODULES]
                found.update(subs or [target])
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def is_tool(name: str) -> bool:
    return name == "ray_reshard.tools" or name.startswith("ray_reshard.tools.")


def test_the_core_never_imports_the_tools():
    # `python -m ray_reshard` hands over to the command line: an entry point, imported by nobody.
    core = [n for n in GRAPH if not is_tool(n) and n != "ray_reshard.__main__"]
    assert len(core) > 60 and len(GRAPH) - len(core) > 20, "the package was not found whole"
    wrong = sorted(f"{n} imports {t}" for n in core for t in GRAPH[n] if is_tool(t))
    assert not wrong, "the core imports the tools:\n" + "\n".join(wrong)


def test_no_import_circle():
    """Tarjan's strongly connected components over the module graph: every one a single module
    (a package's __init__ importing its own submodules is not a circle back to it)."""
    def edges(n: str) -> set[str]:
        return {t for t in GRAPH[n] if not n.startswith(t + ".")}

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges(v)):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            connect(v)
    assert not circles, "modules that import each other (directly or round a circle):\n" + \
        "\n".join(", ".join(c) for c in circles)


def test_no_file_too_long():
    long = sorted(f"{p.relative_to(ROOT)}: {n} lines" for p in MODULES.values()
                  if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES)
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("limit", [MAX_FUNCTION_LINES])
def test_no_function_too_long(limit):
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {limit} lines:\n" + "\n".join(sorted(long))


# What each part may import (docs/architecture.md's parts table): no import runs back up.
MAY_IMPORT = {
    "layout": set(),
    "planning": {"layout", "_gc"},
    "execution": {"planning", "layout", "_gc"},
    "sim": {"execution", "planning", "layout", "_gc"},
    "runtime.transport": {"errors"},
    "runtime": {"runtime.transport", "execution", "planning", "layout", "errors", "_gc"},
    # recipes take the engine layouts from engines/ on first use (inside functions)
    "models": {"engines", "layout", "_gc"},
    "engines": {"models", "layout", "errors"},
    "engines.vllm.backend": {"engines", "models", "runtime", "layout", "errors"},
    "integrations": {"engines", "engines.vllm.backend", "models", "runtime", "layout", "errors"},
    "ray_reshard": {"layout", "planning", "runtime", "models", "session", "errors"},
    "session": set(), "errors": set(), "_gc": set(), "__main__": {"tools"},
}


def part_of(name: str) -> str:
    parts = name.split(".")[1:]
    if not parts:
        return "ray_reshard"
    if parts[:2] == ["runtime", "transport"]:
        return "runtime.transport"
    if parts[:3] == ["engines", "vllm", "backend"]:
        return "engines.vllm.backend"
    return parts[0]


def test_no_import_runs_back_up():
    wrong = []
    for name, targets in GRAPH.items():
        part = part_of(name)
        if part == "tools":
            continue
        assert part in MAY_IMPORT, f"{name}: a part the layering does not know ({part})"
        wrong += [f"{name} ({part}) imports {t} ({part_of(t)})" for t in sorted(targets)
                  if part_of(t) != part and part_of(t) not in MAY_IMPORT[part]]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)
