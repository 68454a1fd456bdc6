"""The packages' import direction, read from the source (AST), so that no cycle comes back unnoticed.

tfdist.kube (the kernel side's Kubernetes objects and watches) and tfdist.runtime (what job processes run)
do not import each other: what both need (the restart policy, the agent's signing, the event records) lives
in tfdist.job, the protocol in the middle, which imports neither.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent.parent / "core"


def imported(path: Path, package: str) -> set[str]:
    """Every tfdist module `path` imports (at any depth: top level, functions, TYPE_CHECKING blocks)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tfdist")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the module's own package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("tfdist"):
                found.add(mod)
                found |= {f"{mod}.{a.name}" for a in node.names}  # `from tfdist import runtime`
    return found


def imports_of(sub: str) -> dict[str, set[str]]:
    out = {}
    for path in sorted((CORE / sub).rglob("*.py")):
        rel = path.relative_to(CORE).with_suffix("")
        package = ".".join(["tfdist", *rel.parts[:-1]])
        out[".".join(["tfdist", *rel.parts])] = imported(path, package)
    return out


def reaching(imports: dict[str, set[str]], target: str) -> dict[str, list[str]]:
    return {
        mod: sorted(m for m in mods if m == target or m.startswith(target + "."))
        for mod, mods in imports.items()
        if any(m == target or m.startswith(target + ".") for m in mods)
    }


def test_the_resolver_sees_relative_and_nested_imports(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from ..runtime import psrestart\ndef f():\n    from tfdist.runtime.spawn import Task\n")
    assert imported(src, "tfdist.kube") == {
        "tfdist.runtime",
        "tfdist.runtime.psrestart",
        "tfdist.runtime.spawn",
        "tfdist.runtime.spawn.Task",
    }


def test_kube_does_not_import_runtime() -> None:
    assert reaching(imports_of("kube"), "tfdist.runtime") == {}


def test_runtime_does_not_import_kube() -> None:
    """Job images run tfdist.runtime: none of the kernel side's Kubernetes code comes with it."""
    assert reaching(imports_of("runtime"), "tfdist.kube") == {}


@pytest.mark.parametrize("other", ["tfdist.runtime", "tfdist.kube", "tfdist.backends"])
def test_the_job_protocol_imports_neither_side(other: str) -> None:
    assert reaching(imports_of("job"), other) == {}
