"""Imports flow one way: kernels <- models <- runtime <- API. The kernels (kernels/, installed as
minidecode.kernels) import nothing of minidecode but themselves; the model (models/, installed as
minidecode.models) imports only the kernels and itself; and no runtime module (minidecode/*.py
but the API's) imports the API, the benchmarks (minidecode/benchmarks/) or the command. An AST
scan of every import, at module level and in functions (TYPE_CHECKING ones too), with relative
imports resolved against the file's package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The folder each installed package comes from (pyproject.toml's package-dir mapping).
PACKAGES = {"kernels": "minidecode.kernels", "models": "minidecode.models", "minidecode": "minidecode"}
# The API: the modules a user (or the command) calls, which may import any runtime module; and
# `minidecode bench`'s measurements (minidecode/benchmarks/), which the runtime never imports.
API = {"llm", "streams", "server", "openai_api", "batch_file", "__init__", "__main__"}
API_MODULES = {f"minidecode.{name}" for name in API - {"__init__"}} | {"minidecode.benchmarks"}


def imported(source: str, package: str) -> list[tuple[int, str]]:
    """Every module a module of the package imports, by its absolute name, with the line it is
    imported on; a `from X import name` lists X.name too (it may be a submodule)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            names.append((node.lineno, module))
            names += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return names


def within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def violations(folder: str, allowed) -> list[str]:
    found = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for line, module in imported(path.read_text(encoding="utf-8"), PACKAGES[folder]):
            if not allowed(path, module):
                found.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    return found


def test_kernels_import_only_kernels():
    def allowed(path, module):
        return not within(module, "minidecode", "minidecode_cli") or within(module, "minidecode.kernels")

    assert violations("kernels", allowed) == []


def test_models_import_only_models_and_kernels():
    def allowed(path, module):
        return not within(module, "minidecode", "minidecode_cli") or within(
            module, "minidecode.kernels", "minidecode.models"
        )

    assert violations("models", allowed) == []


def test_runtime_imports_no_api_nor_command():
    def allowed(path, module):
        api = path.stem in API if path.parent.name == "minidecode" else path.parent.name == "benchmarks"
        return api or not within(module, "minidecode_cli", *API_MODULES)

    assert violations("minidecode", allowed) == []


@pytest.mark.parametrize("folder", ["kernels", "models"])
def test_scan_sees_relative_imports(folder):
    """The scan resolves a relative import to the package it names, so `from .. import x` in
    kernels/ counts as an import of minidecode.x."""
    package = PACKAGES[folder]
    assert imported("from ..errors import UserError\n", package) == [
        (1, "minidecode.errors"),
        (1, "minidecode.errors.UserError"),
    ]
    assert imported("from . import ops\n", package) == [(1, package), (1, f"{package}.ops")]
