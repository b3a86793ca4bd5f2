"""Which built-in algorithms each backend implements so far (the registry advertises only these).

One line per owner so parallel work does not collide; becomes "all of core.algorithms" when complete.
"""

TORCH_PRUNERS: set[str] = set()
TORCH_QUANTIZERS: set[str] = set()
TF_PRUNERS: set[str] = set()
TF_QUANTIZERS: set[str] = set()

BUILT: dict[str, set[str] | None] = {"torch": TORCH_PRUNERS | TORCH_QUANTIZERS, "tf": TF_PRUNERS | TF_QUANTIZERS}
