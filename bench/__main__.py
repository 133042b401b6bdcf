"""Dispatcher: ``python -m bench NAME [--json] [benchmark options]``. With ``--json`` the last
line printed is one JSON object; without it, a readable summary."""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys

import bench


def _names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    names = _names()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m bench NAME [--json] [options]\nbenchmarks: " + ", ".join(names))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"unknown benchmark {name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    as_json = "--json" in rest
    rest = [a for a in rest if a != "--json"]
    result = importlib.import_module(f"bench.{name}").main(rest)
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        for k, v in result.items():
            print(f"{k:>28}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
