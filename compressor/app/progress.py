"""An optional progress bar for the training helpers (the demo's harnesses); outside core, which imports
numpy, yaml and pluggy only.

tqdm is imported when a bar is first asked for (it comes with the ``demo`` extra), never at import time.
"""

from __future__ import annotations

from typing import Any

__all__ = ["progress_bar"]


def progress_bar(iterable: Any, total: int | None, desc: str, enabled: bool | None) -> Any:
    """``iterable`` wrapped in a tqdm bar; ``enabled``: True always, False never, None only on a terminal."""
    from tqdm.auto import tqdm

    disable = {True: False, None: None, False: True}[enabled]
    return tqdm(iterable, total=total, desc=desc, leave=False, disable=disable)
