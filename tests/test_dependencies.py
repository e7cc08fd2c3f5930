"""Every third-party module the runtime and the command use is one that pyproject.toml declares: a
dependency, or the extra of the one feature that imports it. The test extra brings packages of its
own (numpy, through transformers), so the rest of the suite runs fine when a plain
`pip install -e ".[serve]"` lacks one; this test reads the imports instead (an AST scan, top-level
and function-level, of minidecode/, kernels/, models/ and the command's modules in the repo root:
cli.py and its helpers), and .ci/readme_install.sh runs the README's commands in such an install."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("minidecode", "kernels", "models") for p in sorted((REPO / d).rglob("*.py"))]
SOURCES += sorted(REPO.glob("*.py"))  # cli.py and its helpers: the minidecode_cli modules
FIRST_PARTY = {"minidecode", "minidecode_cli"}
# Needed whatever the scan finds: torch imports numpy (and warns "Failed to initialize NumPy"
# without it), and Tensor.numpy() (the cache files' byte views, minidecode/cache_file.py) needs it.
ALWAYS = {"numpy": "torch's import and Tensor.numpy()"}
# A module that a declared requirement is built on, not a requirement of its own.
PROVIDED_BY = {
    "starlette": "fastapi",  # server.py catches Starlette's HTTPException, as FastAPI documents
    "click": "typer",  # cli.py uses click's types and exceptions under typer's
}
# An extra's modules may be imported only by the files of its feature, where a plain install never
# goes: at module level in the module that only the feature imports (server.py: `minidecode serve`)
# and in the modules that only such modules import (feature_files), in a function in one that runs
# without it too (minidecode/benchmarks/e2e.py: `bench --plot` needs matplotlib).
EXTRA_FILES = {
    "serve": {"minidecode/server.py": "module"},
    "bench": {"minidecode/benchmarks/e2e.py": "function"},
}
# Used though declared nowhere (or only by the test extra), where a plain install never imports it.
UNDECLARED = {
    # CUDA builds of torch bring it; the CPU runtime runs the kernels' PyTorch twins and never
    # imports it (tests/test_install.py): anywhere in kernels/
    "triton": "kernels/",
    # `bench --compare transformers` only: in a function, which says how to install it
    "transformers": "minidecode/benchmarks/e2e.py",
}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, requirement
    return normalized(match.group(1))


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """(the dependencies, each extra's requirements), by normalized name; an extra's self-reference
    (`minidecode[serve]`) brings that extra's requirements too."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    core = {requirement_name(r) for r in project["dependencies"]}
    extras: dict[str, set[str]] = {}
    for extra, requirements in optional.items():
        extras[extra] = set()
        for r in requirements:
            if requirement_name(r) != "minidecode":
                extras[extra].add(requirement_name(r))
                continue
            for other in re.search(r"\[(.*?)\]", r).group(1).split(","):
                extras[extra] |= {requirement_name(x) for x in optional[other.strip()]}
    return core, extras


def used_modules() -> tuple[dict[str, list[tuple[str, int, str]]], list[str]]:
    """(top-level module -> [(file, line, how)] of every third-party import (how: "module" or
    "function" level) and `importlib.util.find_spec("...")` (how: "check", the guard of an
    optional feature, allowed anywhere); the places that call `.numpy()`)."""
    modules: dict[str, list[tuple[str, int, str]]] = {}
    numpy_calls = []
    for path in SOURCES:
        rel = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        top = {id(node) for node in tree.body}  # and in a module-level if / try
        top |= {id(n) for node in tree.body if isinstance(node, ast.If | ast.Try) for n in ast.walk(node)}
        for node in ast.walk(tree):
            names, how = [], "module" if id(node) in top else "function"
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "numpy" and not node.args:
                    numpy_calls.append(f"{rel}:{node.lineno}")
                elif node.func.attr == "find_spec" and node.args and isinstance(node.args[0], ast.Constant):
                    names, how = [node.args[0].value], "check"
            for name in names:
                root = name.split(".")[0]
                if root not in FIRST_PARTY and root not in sys.stdlib_module_names:
                    modules.setdefault(root, []).append((rel, node.lineno, how))
    return modules, numpy_calls


def module_of(rel: str) -> str:
    """The module a source file installs as (pyproject's package-dir mapping)."""
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in ("kernels", "models"):
        return ".".join(["minidecode", *parts])
    return f"minidecode_cli.{parts[0]}" if len(parts) == 1 else ".".join(parts)


def feature_files(seeds: set[str]) -> set[str]:
    """`seeds` and every source file that only files of this set import (to a fixed point)."""
    importers: dict[str, set[str]] = {}
    for path in SOURCES:
        rel = path.relative_to(REPO).as_posix()
        package = module_of(rel) if path.name == "__init__.py" else module_of(rel).rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                base = ".".join(p for p in (base, node.module) if p)
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                importers.setdefault(target, set()).add(rel)
    files = set(seeds)
    while True:
        more = {
            rel
            for path in SOURCES
            if (rel := path.relative_to(REPO).as_posix()) not in files
            and importers.get(module_of(rel))
            and importers[module_of(rel)] <= files
        }
        if not more:
            return files
        files |= more


def test_every_module_the_runtime_uses_is_declared():
    core, extras = declared()
    modules, numpy_calls = used_modules()
    allowed_in = {  # extra -> {file: level}
        extra: {f: level for f, level in files.items() if level == "function"}
        | dict.fromkeys(feature_files({f for f, level in files.items() if level == "module"}), "module")
        for extra, files in EXTRA_FILES.items()
    }
    assert {"torch", "typer", "fastapi"} <= modules.keys() and numpy_calls  # the scan sees the code
    problems = []
    for module, why in ALWAYS.items():
        if normalized(module) not in core:
            calls = ", ".join(sorted(set(numpy_calls)))
            problems.append(f"{module} is needed ({why}: .numpy() at {calls}) but is not a dependency")
    for module, places in sorted(modules.items()):
        name = normalized(PROVIDED_BY.get(module, module))
        if name in core:
            continue
        if module in UNDECLARED:
            allowed = UNDECLARED[module]
            for rel, line, how in places:
                if how == "check":
                    continue
                if not rel.startswith(allowed) or (how == "module" and not allowed.endswith("/")):
                    problems.append(f"{rel}:{line} imports {module}, declared nowhere: only in {allowed}")
            continue
        guarding = [e for e in EXTRA_FILES if name in extras[e]]
        if not guarding:
            where = [e for e, names in extras.items() if name in names]
            problems.append(
                f"{module} ({places[0][0]}:{places[0][1]}) is not a dependency"
                + (f"; only the {' / '.join(where)} extra brings it" if where else "")
            )
            continue
        allowed = {f: level for e in guarding for f, level in allowed_in[e].items()}
        for rel, line, how in places:
            if how == "check":
                continue
            if rel not in allowed or (how == "module" and allowed[rel] == "function"):
                where = ", ".join(f"{f} ({level} level)" for f, level in allowed.items())
                problems.append(f"{rel}:{line} imports {module} of the {guarding[0]} extra: only in {where}")
    assert not problems, "\n".join(problems)
