"""Command line: ``python -m pyengine simulate`` (and ``pyengine simulate``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def main(argv: list[str] | None = None) -> int:
    from pyengine.simulate import SimulationConfig, report, run

    parser = argparse.ArgumentParser(prog="pyengine", description="pyengine command line")
    sub = parser.add_subparsers(dest="command")
    sim = sub.add_parser("simulate", help="run the scheduler thread on a random workload with a fake executor")
    for f in dataclasses.fields(SimulationConfig):
        sim.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    sim.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    if args.command in (None, "simulate"):
        if args.command is None:
            args = parser.parse_args(["simulate", *(argv or [])])
        cfg = SimulationConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimulationConfig)})
        stats = run(cfg)
        print(json.dumps(stats) if args.json else report(stats))
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
