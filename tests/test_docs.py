"""README and docs/ snippets are run, so the docs cannot rot; the API reference covers the public API.

Every fenced ``python`` block of README.md and of every page under docs/ must be preceded by a marker line naming where it runs:
``<!-- doctest: core -->`` (no framework: here), ``<!-- doctest: torch -->`` (tests/test_docs_torch.py),
``<!-- doctest: tf -->`` (tests/test_docs_tf.py) or ``<!-- doctest: skip -->``. Each block runs on its own,
in a fresh namespace, in a temporary working directory; plugins it registers are removed afterwards.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from compressor.core import registry as R

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DOC_FILES = [README, *sorted(DOCS.rglob("*.md"))]
ENVS = ("core", "torch", "tf", "skip")
_MARKER = re.compile(r"^<!--\s*doctest:\s*(\w+)\s*-->$")


def readme_blocks(path: Path = README) -> list[tuple[int, str | None, str]]:
    """``(line number, marker or None, code)`` of every fenced python block of ``path`` (README.md)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            j = start
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            m = _MARKER.match(prev)
            out.append((start + 1, m.group(1) if m else None, "\n".join(lines[start:j]) + "\n"))
            i = j
        i += 1
    return out


def params(env: str) -> list:
    """pytest params ``(path, line, code)`` of the blocks marked ``env`` in README.md and docs/, with ids
    ``<file>:<line>``."""
    return [pytest.param(path, line, code, id=f"{path.relative_to(ROOT)}:{line}")
            for path in DOC_FILES for line, marker, code in readme_blocks(path) if marker == env]


def run_block(path: Path, line: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Execute ``code`` (line ``line`` on of the page ``path``) in ``tmp_path``, with tracebacks pointing into
    the page; undo the plugins and in-memory modules it registered."""
    monkeypatch.chdir(tmp_path)
    pm = R.plugin_manager()
    plugins_before = set(pm.get_plugins())
    modules_before = set(sys.modules)
    try:
        source = "\n" * (line - 1) + code  # line numbers as in the page
        exec(compile(source, str(path), "exec"), {"__name__": "__readme__"})  # noqa: S102 - the docs' own code
    finally:
        for plugin in set(pm.get_plugins()) - plugins_before:
            R.unregister_plugin(plugin)
        for mod in set(sys.modules) - modules_before:
            if getattr(sys.modules[mod], "__spec__", None) is None:  # made up by the snippet
                del sys.modules[mod]


def test_every_python_block_says_where_it_runs():
    blocks = [(path, *b) for path in DOC_FILES for b in readme_blocks(path)]
    bad = [f"{path.relative_to(ROOT)}:{line}" for path, line, marker, _ in blocks if marker not in ENVS]
    assert not bad, f"python blocks without a valid '<!-- doctest: {'|'.join(ENVS)} -->' marker: {bad}"
    for env in ("core", "torch", "tf"):
        assert any(marker == env for _, _, marker, _ in blocks), f"no docs block runs in the {env} env"
    assert any(path == README for path, *_ in blocks) and len({p for p, *_ in blocks}) > 5


@pytest.mark.parametrize(("path", "line", "code"), params("core"))
def test_readme_core_block(path, line, code, tmp_path, monkeypatch):
    run_block(path, line, code, tmp_path, monkeypatch)


# ------------------------------------------------------------------ API reference
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$")


def _resolve(dotted: str):
    """The object a mkdocstrings ``::: a.b.C`` directive documents (longest importable module prefix)."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def api_page_objects(page: str) -> dict[str, object]:
    """``{directive path: object}`` of every ``::: path`` in docs/api/<page>.md."""
    lines = (DOCS / "api" / f"{page}.md").read_text(encoding="utf-8").splitlines()
    return {m.group(1): _resolve(m.group(1)) for m in map(_DIRECTIVE.match, lines) if m}


def check_api_page(module, page: str) -> None:
    """Every name of ``module.__all__`` is documented (by identity) on docs/api/<page>.md and has a docstring."""
    import inspect

    documented = api_page_objects(page)
    by_id = {id(obj): path for path, obj in documented.items()}
    missing = [name for name in module.__all__ if id(getattr(module, name)) not in by_id]
    assert not missing, f"{module.__name__}.__all__ names not in docs/api/{page}.md: {missing}"
    undocumented = [name for name in module.__all__ if not inspect.getdoc(getattr(module, name))]
    assert not undocumented, f"{module.__name__} public names without a docstring: {undocumented}"
    for path, obj in documented.items():
        assert path.rsplit(".", 1)[-1] == getattr(obj, "__name__", path.rsplit(".", 1)[-1]), path


def test_api_reference_covers_compressor():
    import compressor

    check_api_page(compressor, "compressor")


def test_readme_links_point_at_files():
    """The front page links into docs/ (GitHub renders the links): every relative target exists."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8"))
    local = [t for t in targets if "://" not in t]
    assert len(local) >= 10 and any(t.startswith("docs/guides/") for t in local)
    assert [t for t in local if not (ROOT / t).exists()] == []
