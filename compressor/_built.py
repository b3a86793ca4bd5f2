"""Which built-in algorithms each backend implements so far (None = all of core.algorithms).

Kept so the registry never advertises a name that would fail to import; shrinks to nothing once both
backends implement every algorithm.
"""

BUILT: dict[str, set[str] | None] = {"torch": set(), "tf": set()}
