"""The package layout holds: no import circles, no Triton or torch where nothing computes,
every package says what it holds, and the README's layout table matches the tree."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Module name prefix -> source directory (pyproject's package-dir).
SOURCES = {"pdchat": ROOT / "backends/pdchat", "pdchat.clients": ROOT / "clients", "pdchat.ensemble": ROOT / "ensemble"}
# Packages whose modules never compute with the model: no torch, no Triton.
NO_TORCH = (
    "pdchat.core.request.protocol",
    "pdchat.core.request.grammar",
    "pdchat.core.kv",
    "pdchat.core.output",
    "pdchat.core.settings",
    "pdchat.core.errors",
    "pdchat.ensemble",
    "pdchat.registry",
    "pdchat.tensors",
    "pdchat.clients.router",
    "pdchat.clients.backend_pool",
    "pdchat.clients.fronts",
    "pdchat.clients.chat",
)


def modules() -> dict[str, Path]:
    found = {}
    for prefix, directory in SOURCES.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            if prefix == "pdchat" and parts[0] in ("clients", "ensemble"):
                continue
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((prefix, *parts))] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module imported anywhere in the file (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {m for m in imports(path) if m in known and m != name} for name, path in known.items()}


def test_no_import_circles():
    edges, state, stack, cycles = graph(), {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                cycles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert cycles == []


def test_no_triton_in_core_and_no_torch_where_nothing_computes():
    for name, path in modules().items():
        used = imports(path)
        if name.startswith(("pdchat.core", "pdchat.ensemble", "pdchat.clients")):
            assert "triton_python_backend_utils" not in used, name
        if name.startswith(NO_TORCH):
            assert not {m for m in used if m.split(".")[0] in ("torch", "transformers", "xgrammar")} - {"xgrammar"}, (
                name
            )


def test_the_router_process_never_imports_torch():
    script = (
        "import sys, json; from pdchat.clients import router, openai_api; "
        "from pdchat.core.request.protocol import chat_request_from_body; "
        "chat_request_from_body({'messages': [{'role': 'user', 'content': 'x'}], "
        "'response_format': {'type': 'json_schema', 'json_schema': {'schema': {'type': 'object'}}}}, check_grammar=False); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'xgrammar'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


@pytest.mark.parametrize("package", sorted(n for n, p in modules().items() if p.name == "__init__.py"))
def test_every_package_says_what_it_holds(package):
    tree = ast.parse(modules()[package].read_text())
    assert len(ast.get_docstring(tree) or "") > 40, f"{package}/__init__.py needs a docstring saying what it holds"


def test_readme_layout_table_matches_the_tree():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| path | role |") :]
    table = table[: table.index("\n\n")]
    listed = re.findall(r"^\| `([^`]+)/?` \|", table, flags=re.M)
    assert listed, "the README has a layout table"
    for path in listed:
        assert (ROOT / path).exists(), f"README lists {path}, which is not in the tree"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    top = {p.split("/")[0] for p in tracked if "/" in p and not p.startswith(".")}
    assert top <= {p.split("/")[0].rstrip("/") for p in listed}, (
        f"top-level folders missing from the README table: {top}"
    )
