"""Repository hygiene: no absolute machine paths in tracked files, and results pages that read as current tables.

* Every file ``git ls-files`` lists, outside ``tests/``, is searched for absolute paths that exist on one machine
  only (``/work/``, ``/root/``, ``/tmp/``, ``/home/<user>``, ``/Users/``, macOS temp folders, ``C:\\...``). Web
  addresses are not paths and are left out; so are relative paths (``out/llm``, ``./tmp/``) and paths under
  ``$VAR`` / ``~``. Caches and tools belong in arguments or environment variables with relative defaults.
* The headings of ``examples/RESULTS.md`` and ``benchmarks/RESULTS.md`` may not be titled by a date, a work
  session, a rerun or a work round (``h18``): those pages hold one current table per experiment, history is in git.

Plain pytest, no framework needed (the core tox env runs it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: an absolute path that only makes sense on one machine; it must start the path (not follow a word, a dot, a
#: slash, ``~`` or a ``$VAR`` / ``${VAR}``): ``out/tmp/x`` or ``$HOME/tmp`` are not machine paths
MACHINE_PATH = re.compile(
    r"(?<![\w.~$}/\\-])"
    r"(?:/(?:work|root|tmp|Users|private/var/folders|var/folders)/"
    r"|/home/[A-Za-z_][\w.-]*"
    r"|[A-Za-z]:\\{1,2}(?=[A-Za-z]))"
)
#: web and repository addresses: their path part is not a path on this machine (``file://`` is not left out)
URL = re.compile(r"\b(?:https?|s?ftp|git|ssh)://\S+")

RESULTS_PAGES = ("examples/RESULTS.md", "benchmarks/RESULTS.md")
#: what a heading of a results page may not be titled by: a date, a work session, a rerun, a work round
NOTEBOOK_HEADING = {
    "a date": re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),
    "a work session": re.compile(r"\bsessions?\s*#?\s*\d+", re.IGNORECASE),
    "a rerun": re.compile(r"\bre-?run", re.IGNORECASE),
    "a work round": re.compile(r"\bh\d{1,3}\b"),  # lower-case: "h18", not "H200"
}
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def machine_paths(text: str) -> list[tuple[int, str]]:
    """``(line number, path)`` for every absolute machine path in ``text``."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in MACHINE_PATH.finditer(URL.sub(" ", line).replace("file://", " ")):
            hits.append((n, m.group(0)))
    return hits


def notebook_headings(text: str) -> list[tuple[int, str, str]]:
    """``(line number, heading, why)`` for every Markdown heading (outside fenced code) titled like a lab notebook."""
    hits, fence = [], None
    for n, line in enumerate(text.splitlines(), 1):
        f = FENCE.match(line)
        if f:
            if fence is None:
                fence = f.group(1)[0]
            elif f.group(1)[0] == fence:
                fence = None
            continue
        if fence is not None:
            continue
        h = HEADING.match(line)
        if not h:
            continue
        why = [what for what, pattern in NOTEBOOK_HEADING.items() if pattern.search(h.group(2))]
        if why:
            hits.append((n, h.group(2), " and ".join(why)))
    return hits


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"git ls-files failed: {out.stderr.decode(errors='replace').strip()}")
    return [p for p in out.stdout.decode().split("\0") if p]


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary, unreadable or absent file (deleted but not yet staged)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


# ------------------------------------------------------------------------------------------ the checks themselves
@pytest.mark.parametrize("line", [
    'WEIGHTS = "/work/llmcache/llama-bytes-seed0-steps260.pt"',
    "python -m venv /tmp/llmc && /tmp/llmc/bin/pip install llmcompressor",
    "see /root/.cache/huggingface",
    "cached in /home/alice/models",
    "`/Users/bob/data/mnist`",
    "DEFAULT = '/private/var/folders/x1/T/run'",
    r'open("C:\\Users\\carol\\mnist")',
    r"C:\data\mnist.npz",
    "file:///tmp/site/index.html",
    "(--llmc-python, default /tmp/llmc/bin/python;",
])
def test_machine_paths_are_found(line):
    assert machine_paths("first line\n" + line) and machine_paths("first line\n" + line)[0][0] == 2


@pytest.mark.parametrize("line", [
    "cached in out/llm (or $COMPRESSOR_LLM_CACHE)",
    "python -m venv .venv-llmc && .venv-llmc/bin/pip install llmcompressor",
    "see https://example.com/home/user/tmp/ and git://host/work/repo",
    "mkdocs build --site-dir site/",
    "echo $TMPDIR/tmp/x ${HOME}/work/x ~/work/notes",
    "a relative ./tmp/ or build/tmp/ folder",
    "/proc/self/status and /dev/null and /usr/bin/env python",
    "the homepage / home directory",
    r'"key:\\nvalue"',
])
def test_relative_paths_urls_and_system_files_are_not_machine_paths(line):
    assert machine_paths(line) == []


@pytest.mark.parametrize("heading", [
    "## Rerun on an AVX-512 machine (2026-11-26): one table",
    "### Quiet rerun",
    "#### The solvers in place (session 39)",
    "### Transformers, quiet re-run",
    "### Memory: the all-or-nothing backup off the heap (h18)",
    "## One-shot compression cost, run by hand on 2026-11-25",
])
def test_notebook_headings_are_found(heading):
    hits = notebook_headings("# Results\n\ntext\n\n" + heading + "\n")
    assert [n for n, _, _ in hits] == [5]


@pytest.mark.parametrize("text", [
    "## On a CUDA GPU (NVIDIA H200)\n### AWQ variants\n## Known gaps\n",
    "## Seed spread (LeNet-300-100, seeds 0-4)\n",
    "```\n# the rows marked, after the export moved to opset 20 (2026-11-27, rerun)\n```\n",
    "text that says rerun and 2026-11-27 is not a heading\n",
])
def test_plain_headings_and_code_blocks_pass(text):
    assert notebook_headings(text) == []


# ------------------------------------------------------------------------------------------ the repository
def test_no_absolute_machine_paths_in_tracked_files():
    bad = []
    for rel in tracked_files():
        if rel.startswith("tests/"):
            continue
        text = read_text(ROOT / rel)
        if text is None:
            continue
        bad += [f"{rel}:{n}: {path}" for n, path in machine_paths(text)]
    assert not bad, ("absolute machine paths in tracked files (use an argument or an environment variable with a "
                     "relative default, or a relative / placeholder path in docs):\n" + "\n".join(bad))


@pytest.mark.parametrize("page", RESULTS_PAGES)
def test_results_headings_are_not_a_lab_notebook(page):
    path = ROOT / page
    if not path.is_file():
        pytest.skip(f"{page} not in this checkout")
    bad = [f"{page}:{n}: {heading!r} is titled by {why}" for n, heading, why in notebook_headings(path.read_text())]
    assert not bad, ("results pages hold one current table per experiment; history is in git:\n" + "\n".join(bad))


ISSUE_REF = re.compile(r"\b[Ii]ssue[ -]?#?\d+")


def test_issue_references_are_found_in_sample_lines():
    assert ISSUE_REF.search('"""Calibration data (issue 25)."""')
    assert ISSUE_REF.search("measured on the issue-25 Llama")
    assert not ISSUE_REF.search("an issue with the tokenizer; see benchmarks/RESULTS.md")


def test_library_code_names_what_it_does_not_the_issue_it_came_from():
    """Docstrings and comments in compressor/ say what a measurement was made on, not which tracker issue asked for
    it (the history is in git)."""
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
           for p in sorted((ROOT / "compressor").rglob("*.py"))
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if ISSUE_REF.search(line)]
    assert not bad, "\n".join(bad)
