"""The ``compressor`` command line. Exit codes: 0 ok, 2 bad input (one readable line on stderr)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .core.errors import BackendNotAvailable, ConfigError, ModelError


def _cmd_list(args: argparse.Namespace) -> int:
    from .core.registry import registry

    reg = registry()
    if args.json:
        print(json.dumps({"backends": {b: i.installed for b, i in reg.backends.items()},
                          "algorithms": reg.available()}, indent=2))
        return 0
    for name, info in sorted(reg.backends.items()):
        state = "installed" if info.installed else f"not installed (pip install 'compressor[{name}]')"
        print(f"backend {name}: {info.description} [{state}]")
    for backend, kinds in reg.available().items():
        for kind, names in kinds.items():
            print(f"  {backend} {kind}: {', '.join(names) if names else '(none yet)'}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    print("compressor demo: the training demo arrives with the examples; installed backends and algorithms:")
    return _cmd_list(argparse.Namespace(json=False))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compressor", description="Pruning and quantization for PyTorch and Keras 3")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="backends and algorithms installed (incl. plugins)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_cmd_list)
    demo = sub.add_parser("demo", help="run the demo")
    demo.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ModelError, BackendNotAvailable, FileNotFoundError) as e:
        print(f"compressor: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
