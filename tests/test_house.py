"""The shape of the package, checked: layers import downward only, no cycles, modules and functions stay small,
docs/DESIGN.md's file map names every module, and a sync method lives in its own file.

Pure reading of the source (ast): nothing is imported or run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sparsecomm"
DESIGN = ROOT / "docs" / "DESIGN.md"

# Each module's layer: a module may import its own layer (no cycles) and the ones below.
# The longest matching prefix decides; a module no prefix matches fails test_every_module_has_a_layer.
LAYERS: Dict[str, int] = {
    "sparsecomm.types": 0, "sparsecomm.ownership": 0, "sparsecomm.cost_model": 0, "sparsecomm.synthetic": 0,
    "sparsecomm.version": 0, "sparsecomm._cuda": 0, "sparsecomm._C": 0,
    "sparsecomm._library": 1, "sparsecomm._kernels": 1,
    "sparsecomm.ops": 2,
    "sparsecomm.collectives": 3,
    "sparsecomm.hooks": 4, "sparsecomm.sharded": 4,
    "sparsecomm.planner": 5, "sparsecomm.prices": 5, "sparsecomm.table_wise": 5, "sparsecomm.sample_batch": 5,
    "sparsecomm.parallel": 6, "sparsecomm.replan": 6, "sparsecomm.replan_checks": 6,
    "sparsecomm.trial": 6, "sparsecomm.placement": 6, "sparsecomm.stale": 6,
    "sparsecomm": 7,
    "sparsecomm.bench": 8,
}
# Layers side by side that must not import each other.
APART = [("sparsecomm.hooks", "sparsecomm.sharded")]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _modules() -> Dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> Tuple[str, int]:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise KeyError(module)
    return best, LAYERS[best]


def _imports(module: str, path: Path) -> List[Tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for every import of the package in ``path``."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_function) for a in child.names if a.name.startswith("sparsecomm"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1] + [base]).strip(".")
                if base.startswith("sparsecomm"):
                    for a in child.names:
                        sub = f"{base}.{a.name}"
                        known = sub in MODULES or sub == "sparsecomm._C"  # the compiled kernels
                        out.append((sub if known else base, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    missing = []
    for m in MODULES:
        try:
            _layer(m)
        except KeyError:
            missing.append(m)
    assert not missing, f"modules without a layer in tests/test_house.py LAYERS: {missing}"


def test_imports_point_downward():
    upward = []
    for m, imports in GRAPH.items():
        mine, level = _layer(m)
        for target, line, _ in imports:
            if target == m or target.startswith(m + ".") and MODULES[m].name == "__init__.py":
                continue  # a package's face handing on its own submodules
            theirs, other = _layer(target)
            if other > level:
                upward.append(f"{MODULES[m].relative_to(ROOT)}:{line} imports {target} (layer {other} > {level})")
            for a, b in APART:
                if (mine.startswith(a) and theirs.startswith(b)) or (mine.startswith(b) and theirs.startswith(a)):
                    upward.append(f"{MODULES[m].relative_to(ROOT)}:{line} imports {target} across {a} / {b}")
    assert not upward, "\n".join(upward)


def test_no_import_cycles_and_no_imports_hidden_in_functions():
    # Package faces (__init__) hand on names: an edge into a package means its face, which imports its parts.
    edges: Dict[str, Set[str]] = {m: {t for t, _, _ in imps if t != m} for m, imps in GRAPH.items()}
    hidden = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t} inside a function"
              for m, imps in GRAPH.items() for t, line, local in imps
              if local and not t.startswith("sparsecomm._C") and not m.startswith("sparsecomm.bench")
              and _layer(t)[1] <= _layer(m)[1] and t in MODULES and _reaches(edges, t, m)]
    assert not hidden, "imports moved into functions to dodge a cycle:\n" + "\n".join(hidden)
    cycles = [m for m in MODULES if any(_reaches(edges, t, m) for t in edges[m]
                                        if not (MODULES[m].name == "__init__.py" and t.startswith(m + ".")))]
    assert not cycles, f"modules in an import cycle: {cycles}"


def _reaches(edges: Dict[str, Set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m in seen or m not in edges:
            continue
        seen.add(m)
        # A package's face is where its parts' imports of the package land; do not walk into its parts.
        todo.extend(edges[m])
    return False


def _code_lines(lines: List[str], first: int, last: int) -> int:
    return sum(1 for line in lines[first - 1:last] if line.strip() and not line.strip().startswith("#"))


def test_modules_and_functions_stay_small():
    big = []
    for m, path in MODULES.items():
        if m.startswith("sparsecomm.bench"):
            continue
        lines = path.read_text().splitlines()
        if len(lines) > MAX_MODULE_LINES:
            big.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                body = body[1:]
            if body and _code_lines(lines, body[0].lineno, node.end_lineno) > MAX_FUNCTION_LINES:
                big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                           f"{_code_lines(lines, body[0].lineno, node.end_lineno)} lines of code")
    assert not big, "\n".join(big)


def _file_map() -> str:
    text = DESIGN.read_text()
    start = text.index("## 1. Layers and data path")
    return text[start:text.index("\n## ", start + 5)]


def test_design_file_map_names_every_module_and_only_real_files():
    text = _file_map()
    named = set(re.findall(r"[\w/]+\.(?:py|cpp|cu|cuh|h)\b", text))
    missing = []
    for m, path in MODULES.items():
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and path.parent != PACKAGE and len(path.read_text().splitlines()) < 40:
            continue  # a package's face: the folder is named
        if rel not in named and path.name not in named and rel.replace("sparsecomm/", "") not in named:
            missing.append(rel)
    assert not missing, f"docs/DESIGN.md's file map does not name: {missing}"
    for name in named:
        candidates = [ROOT / name, PACKAGE / name, ROOT / "csrc" / name]
        candidates += list(PACKAGE.rglob(Path(name).name)) + list((ROOT / "csrc").rglob(Path(name).name))
        assert any(c.exists() for c in candidates), f"docs/DESIGN.md's file map names {name}, which does not exist"


# Callers that take one particular method on purpose, by its enum member or the API's default: the public
# signature's default (sparse.py), the hook's first sync of a table (measures on the default), the hook's fused
# dense buckets and dense-gradient rows, the hot rows' allgather. Listed, so that a new one is a decision.
USES = {"sparsecomm/collectives/sparse.py", "sparsecomm/hooks/state.py", "sparsecomm/hooks/hook.py",
        "sparsecomm/sharded/hot.py"}


def test_a_sync_method_is_named_in_its_own_file_and_the_enum_only():
    """Besides its callers, a method is named (as a string or a SyncMethod member) in at most 3 library or
    benchmark files: its own file(s) (a hierarchical variant's file names the method it refines) and the enum.

    What names a method: a SyncMethod member, a ``method=`` argument, a dict key or a comparison with its
    name (a per-method table or a dispatch). A bare string elsewhere may be something else of the same name
    (the ``allgather`` peer of ``bench/sparse_sync``, the ``allgather`` collective of ``bench/allreduce``).
    """
    from sparsecomm.collectives import methods

    files = [p for p in list(PACKAGE.rglob("*.py")) + list((ROOT / "benchmarks").glob("*.py"))]
    for method in {p.method for p in methods.PATHS}:
        family = [p for p in methods.PATHS if p.method is method]
        names = "|".join(re.escape(p.name) for p in family) + "|" + re.escape(method.value)
        quoted = rf"""["'](?:{names})["']"""
        pattern = re.compile(rf"""SyncMethod\.{method.name}\b|method=\s*{quoted}|{quoted}\s*:|[=!]=\s*{quoted}""")
        naming = sorted(p.relative_to(ROOT).as_posix() for p in files if pattern.search(p.read_text()))
        naming = [p for p in naming if p not in USES]
        assert len(naming) <= 3, f"the {method.value} method is named in {naming}"
