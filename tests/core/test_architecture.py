"""The layering of ``compressor/`` (issue 24), checked on the source: every import, module-level or inside a
function, read from the AST. A failure names the modules and the import that breaks the rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "compressor"

#: the bottom of each backend: they may import each other and core, nothing above them
TORCH_BASE = {f"compressor.torch.{m}" for m in (
    "ops", "modules", "families", "hooks", "distributed", "layout", "slots", "ties", "compressor",
    "pruning.wrapper", "quantization.wrapper", "quantization.grad", "quantization.fakequant")}
TF_BASE = {f"compressor.tf.{m}" for m in (
    "ops", "layout", "slots", "hooks", "distributed", "compressor", "pruning.wrapper", "quantization.wrapper",
    "quantization.grad")}
#: pure declaration modules the base may read (they import core only)
PLUGINS = {"compressor.torch_plugin", "compressor.tf_plugin"}
#: model-family integrations: reached through the registry's model-family hook, imported by no module
FAMILY_MODULES = {"compressor.torch.hf"}
#: the application (CLI, report readers, demos) imports the library; outside it only these import it: the
#: ``python -m compressor`` entry point and the old paths kept as aliases of its modules
APP = "compressor.app"
APP_IMPORTERS = {"compressor.__main__", "compressor.cli", "compressor.report", "compressor.demo"}
#: the seed-004 prototype API, imported only by the namespaces users import it from
COMPAT = "compressor.compat"
COMPAT_IMPORTERS = {"compressor.torchCompressor", "compressor.tfCompressor"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _targets(mod: str, node: ast.AST, is_pkg: bool) -> list[str]:
    """Absolute names ``node`` imports: a submodule when ``from pkg import sub`` names one, else the module."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in MODULES else prefix for a in node.names]


def _imports() -> dict[str, set[str]]:
    """Module -> every absolute module name it imports (inside compressor/ or not)."""
    out = {}
    for mod, path in MODULES.items():
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update(_targets(mod, node, path.name == "__init__.py"))
        names.discard(mod)
        out[mod] = names
    return out


IMPORTS = _imports()
EDGES = {m: {d for d in deps if d in MODULES} for m, deps in IMPORTS.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_planted_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve_to_submodules():
    assert "compressor.torch.modules" in EDGES["compressor.torch.layout"]
    assert "compressor.core.errors" in EDGES["compressor.core.config"]
    assert "compressor.core" not in EDGES["compressor.core.config"]


def test_no_import_cycle_in_compressor():
    cycles = _cycles(EDGES)
    detail = "\n".join(f"{m} imports {sorted(EDGES[m] & set(c))}" for c in cycles for m in c)
    assert not cycles, f"import cycles in compressor/:\n{detail}"


def _bad(mods: set[str], allowed) -> list[str]:
    return sorted(f"{m} imports {d}" for m in mods for d in IMPORTS[m] if not allowed(d))


def test_core_imports_no_backend_and_no_framework():
    core = {m for m in MODULES if m == "compressor.core" or m.startswith("compressor.core.")}
    assert len(core) > 20

    def allowed(d: str) -> bool:
        top = d.split(".")[0]
        if top == "compressor":
            return d == "compressor.core" or d.startswith("compressor.core.")
        return top not in ("torch", "tensorflow", "keras", "transformers", "onnx", "onnxruntime")

    assert _bad(core, allowed) == []


@pytest.mark.parametrize("backend,other", [("torch", ("tf", "tensorflow", "keras")), ("tf", ("torch",))])
def test_backends_do_not_import_each_other(backend, other):
    mods = {m for m in MODULES if m.startswith(f"compressor.{backend}.") or m == f"compressor.{backend}"}

    def allowed(d: str) -> bool:
        parts = d.split(".")
        if parts[0] == "compressor":
            return len(parts) < 2 or parts[1] not in ("tf", "torch", "tf_plugin", "torch_plugin") or parts[1] in (
                backend, f"{backend}_plugin")
        return parts[0] not in other

    assert _bad(mods, allowed) == []


@pytest.mark.parametrize("base", [TORCH_BASE, TF_BASE], ids=["torch", "tf"])
def test_base_layers_import_nothing_above_them(base):
    assert base <= set(MODULES), sorted(base - set(MODULES))

    def allowed(d: str) -> bool:
        return (not d.startswith("compressor") or d in base or d in PLUGINS
                or d == "compressor.core" or d.startswith("compressor.core."))

    assert _bad(base, allowed) == []


def test_model_families_are_plugins_imported_by_no_module():
    assert FAMILY_MODULES <= set(MODULES)
    assert sorted(f"{m} imports {d}" for m, deps in EDGES.items() for d in deps if d in FAMILY_MODULES) == []
    plugin = (PKG / "torch_plugin.py").read_text()
    assert '"compressor.torch.hf:FAMILY"' in plugin  # declared there, as a lazy string


def _imports_of_package(edges: dict[str, set[str]], pkg: str, importers: set[str]) -> list[str]:
    """``m imports d`` for every module ``m`` outside ``pkg`` and not in ``importers`` that imports ``pkg``."""

    def inside(name: str) -> bool:
        return name == pkg or name.startswith(f"{pkg}.")

    return sorted(f"{m} imports {d}" for m, deps in edges.items() if not inside(m) and m not in importers
                  for d in deps if inside(d))


def test_package_rule_finds_a_planted_import():
    edges = {"compressor.core.x": {"compressor.app.cli"}, "compressor.app.cli": {"compressor.core.x"},
             "compressor.cli": {"compressor.app.cli"}}
    assert _imports_of_package(edges, APP, APP_IMPORTERS) == ["compressor.core.x imports compressor.app.cli"]
    assert _imports_of_package({"compressor.torch.x": {"compressor.compat"}}, COMPAT, COMPAT_IMPORTERS) == [
        "compressor.torch.x imports compressor.compat"]


def test_the_library_does_not_import_the_app():
    assert {APP, f"{APP}.cli", f"{APP}.report", f"{APP}.demo"} | APP_IMPORTERS <= set(MODULES)
    assert _imports_of_package(EDGES, APP, APP_IMPORTERS) == []


def test_compat_is_imported_only_by_the_seed_namespaces():
    assert {COMPAT} | COMPAT_IMPORTERS <= set(MODULES)
    assert _imports_of_package(EDGES, COMPAT, COMPAT_IMPORTERS) == []


@pytest.mark.parametrize("mod", sorted(APP_IMPORTERS | COMPAT_IMPORTERS))
def test_root_shims_hold_no_code(mod):
    """The app's old paths and the seed-004 namespaces only import (and alias) what lives in app/ and compat/."""
    tree = ast.parse(MODULES[mod].read_text())
    code = [type(n).__name__ for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Lambda))]
    assert code == [] and len(tree.body) <= 6, (mod, code, len(tree.body))
