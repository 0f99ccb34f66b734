"""A new kernel touches four files; these checks keep it so.

``csrc/<op>.cpp`` (the CPU kernel with its binding), ``csrc/cuda/<op>.cu`` (the
CUDA kernel), ``sparsecomm/_library/_<job>.py`` (the operator, with its CUDA
launch) and ``sparsecomm/ops/_<job>.py`` (the validated wrapper): no central
file lists the ops. Pure reading of the sources, plus the import of the package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import sparsecomm.ops
from sparsecomm import _C
from sparsecomm._library._registry import op_names

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
PACKAGE = ROOT / "sparsecomm"

_M_DEF = re.compile(r'\bm\.def\(\s*"(\w+)"')
_CLASS = re.compile(r'py::class_<\w+>\(m,\s*"(\w+)"')
_BIND = re.compile(r"^\s*SPARSECOMM_BIND\((\w+)\)", re.M)
# What bindings.cpp may bind itself: module facts that belong to no kernel.
_MODULE_FACTS = {"advise_huge_pages", "openmp_enabled"}


def _kernel_files():
    return sorted(p for p in CSRC.glob("*.cpp") if p.name != "bindings.cpp")


def test_bindings_cpp_binds_no_op():
    text = (CSRC / "bindings.cpp").read_text()
    assert set(_M_DEF.findall(text)) <= _MODULE_FACTS, "an op binds itself in its own .cpp (SPARSECOMM_BIND)"
    assert not _CLASS.findall(text)
    assert "binders()" in text, "bindings.cpp runs the registered binders"


def test_each_kernel_file_binds_itself_once_under_its_own_name():
    names = []
    for path in _kernel_files():
        binders = _BIND.findall(path.read_text())
        assert len(binders) <= 1, f"{path.name}: one SPARSECOMM_BIND a file"
        names += binders
    assert len(names) == len(set(names)), names
    # Everything the module offers comes from a binder or from bindings.cpp's module facts.
    bound = {n for p in _kernel_files() for n in _M_DEF.findall(p.read_text()) + _CLASS.findall(p.read_text())}
    public = {n for n in dir(_C) if not n.startswith("_")}
    assert public == bound | _MODULE_FACTS


def test_ops_h_declares_only_helpers_that_several_kernel_files_share():
    declared = re.findall(r"^\w[\w:<>,\s\*&]*?\b(\w+)\(", (CSRC / "ops.h").read_text(), re.M)
    assert declared
    for name in declared:
        users = [p.name for p in _kernel_files() if re.search(rf"\b{name}\(", p.read_text())]
        assert len(users) >= 2, f"ops.h declares {name}, used by {users} only: declare it in its kernel's file"


def _code_names(path: Path) -> set:
    """Identifiers and string constants of a module, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.add(node.value)
    return names


def test_the_cuda_loader_names_no_op():
    ops = {name.rstrip("_") for name in op_names()}
    named = {(op, n) for n in _code_names(PACKAGE / "_cuda.py") for op in ops if op in n}
    assert not named, f"sparsecomm/_cuda.py names ops (their launches belong in sparsecomm/_library): {named}"
    assert not any(n.startswith("sparsecomm_") for n in _code_names(PACKAGE / "_cuda.py")), "no kernel names"


def test_ops_exports_each_job_modules_names_without_a_line_per_op():
    tree = ast.parse((PACKAGE / "ops" / "__init__.py").read_text())
    jobs = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module.startswith("sparsecomm.ops."):
            job = node.module.rpartition(".")[2]
            if job != "_validate":
                assert [a.name for a in node.names] == ["*"], f"ops/__init__.py imports names of {job} one by one"
                jobs.append(job)
    assert jobs
    exported = {name for job in jobs for name in getattr(sparsecomm.ops, job).__all__}
    assert set(sparsecomm.ops.__all__) == exported | {"INDEX_DTYPES", "VALUE_DTYPES"}
    assert all(hasattr(sparsecomm.ops, name) for name in sparsecomm.ops.__all__)
