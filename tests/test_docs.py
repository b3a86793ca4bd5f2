"""README snippets are run, so the docs cannot rot.

Every fenced ``python`` block of README.md must be preceded by a marker line naming where it runs:
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

README = Path(__file__).resolve().parent.parent / "README.md"
ENVS = ("core", "torch", "tf", "skip")
_MARKER = re.compile(r"^<!--\s*doctest:\s*(\w+)\s*-->$")


def readme_blocks() -> list[tuple[int, str | None, str]]:
    """``(line number, marker or None, code)`` of every fenced python block of README.md."""
    lines = README.read_text(encoding="utf-8").splitlines()
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
    """pytest params ``(line, code)`` of the blocks marked ``env``, with ids ``README.md:<line>``."""
    return [pytest.param(line, code, id=f"README.md:{line}") for line, marker, code in readme_blocks() if marker == env]


def run_block(line: int, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Execute ``code`` (README line ``line`` on) in ``tmp_path``, with tracebacks pointing into README.md;
    undo the plugins and in-memory modules it registered."""
    monkeypatch.chdir(tmp_path)
    pm = R.plugin_manager()
    plugins_before = set(pm.get_plugins())
    modules_before = set(sys.modules)
    try:
        source = "\n" * (line - 1) + code  # line numbers as in README.md
        exec(compile(source, str(README), "exec"), {"__name__": "__readme__"})  # noqa: S102 - the docs' own code
    finally:
        for plugin in set(pm.get_plugins()) - plugins_before:
            R.unregister_plugin(plugin)
        for mod in set(sys.modules) - modules_before:
            if getattr(sys.modules[mod], "__spec__", None) is None:  # made up by the snippet
                del sys.modules[mod]


def test_every_python_block_says_where_it_runs():
    blocks = readme_blocks()
    bad = [line for line, marker, _ in blocks if marker not in ENVS]
    assert not bad, f"README.md python blocks without a valid '<!-- doctest: {'|'.join(ENVS)} -->' marker at lines {bad}"
    for env in ("core", "torch", "tf"):
        assert any(marker == env for _, marker, _ in blocks), f"no README block runs in the {env} env"


@pytest.mark.parametrize(("line", "code"), params("core"))
def test_readme_core_block(line, code, tmp_path, monkeypatch):
    run_block(line, code, tmp_path, monkeypatch)
