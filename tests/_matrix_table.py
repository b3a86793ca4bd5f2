"""The "supported families" markdown table of the family matrices (tests/torch/test_family_matrix.py and
tests/tf/test_family_matrix.py, ``--table``): family x method, "pass" (with the case's remark) or the reason it
fails, one numbered note per reason."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any


def markdown_table(families: Iterable[str], methods: Iterable[str], xfail: Mapping[tuple[str, str], tuple[Any, ...]],
                   run: Callable[[str, str], str | None]) -> str:
    """``run(family, method)``: the case's remark (None: none), or it raises. ``xfail``: ``(family, method) ->
    (reason, ...)`` of the cases listed as failing."""
    methods = list(methods)
    lines = ["| family | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    notes: dict[str, list[tuple[str, str]]] = {}
    for family in families:
        cells = []
        for method in methods:
            try:
                remark, got = run(family, method), None
            except Exception as e:  # noqa: BLE001 - the table says what failed
                remark, got = None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            why = xfail.get((family, method), (None,))[0]
            if got is None:
                cell = "pass" if why is None else "pass (listed as failing!)"
                cells.append(f"{cell} ({remark})" if remark else cell)
                continue
            notes.setdefault(why or got, []).append((family, method))
            k = list(notes).index(why or got) + 1
            cells.append(f"fails ({k})" if why else f"**unexpected failure** ({k})")
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    if notes:
        lines.append("")
    for i, (why, cases) in enumerate(notes.items(), 1):
        by_family = {f: [c for g, c in cases if g == f] for f in dict.fromkeys(f for f, _ in cases)}
        who = "; ".join(f"{f} (every method)" if len(ms) == len(methods) else f"{f} x {', '.join(ms)}"
                        for f, ms in by_family.items())
        lines.append(f"{i}. {who}: {why}")
    return "\n".join(lines)
