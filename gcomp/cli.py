"""The ``gcomp`` command: ``gcomp list``, ``gcomp describe NAME``."""
from __future__ import annotations

import argparse
import sys

import gcomp


def _list(args) -> int:
    names = gcomp.available()
    collectives = {name: gcomp.create(name).communicator.collective for name in names}
    width = max(map(len, names), default=0)
    column = max(map(len, collectives.values()), default=0)
    for name in names:
        print(f"{name:<{width}}  {collectives[name]:<{column}}  {gcomp.spec(name).summary}")
    return 0


def _describe(args) -> int:
    try:
        print(gcomp.describe(args.name))
    except gcomp.UnknownMethodError as err:
        print(f"gcomp: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gcomp", description="Gradient compression for PyTorch DDP.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="registered methods, their collective and a one-line summary").set_defaults(run=_list)
    p = sub.add_parser("describe", help="a method's parameters, defaults, ranges and wire format")
    p.add_argument("name")
    p.set_defaults(run=_describe)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
