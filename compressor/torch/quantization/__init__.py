"""(being built)"""

__all__: list[str] = []
