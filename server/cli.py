"""The ``rtvideo`` command line: ``serve`` and ``bench``.

Every option of ``serve`` can also be set from the environment (``RTVIDEO_*``);
this module is the one place that reads it.
"""

from __future__ import annotations

import argparse
import sys


def _bench_engine(args: argparse.Namespace) -> int:
    from server import bench_engine

    options = bench_engine.BenchOptions(
        step_ms=args.step_ms,
        chunks=args.chunks,
        interactions=args.interactions,
        seed=args.seed,
        repeats=args.repeats,
        spin=not args.sleep,
    )
    return bench_engine.main(options, as_json=args.json)


def _serve(args: argparse.Namespace) -> int:
    print(
        "rtvideo serve: the HTTP/WebSocket front end is not built yet; it lands with the front-end work.\n"
        "Until then the engine runs under `rtvideo bench engine` and the test suite (`make test`).",
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtvideo", description="Realtime video generation server.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the server")
    serve.set_defaults(func=_serve)

    bench = commands.add_parser("bench", help="benchmarks; each prints a JSON summary as its last line")
    benches = bench.add_subparsers(dest="bench", required=True)
    engine = benches.add_parser("engine", help="engine loop overhead and interaction lag over the stub pipeline")
    engine.add_argument("--json", action="store_true", help="print only the JSON summary")
    engine.add_argument("--step-ms", type=float, default=10.0, help="simulated denoise step time (default 10)")
    engine.add_argument("--chunks", type=int, default=20, help="chunks per overhead run (default 20)")
    engine.add_argument("--interactions", type=int, default=20, help="interactions per mode (default 20)")
    engine.add_argument("--seed", type=int, default=0, help="seed for the interaction timings")
    engine.add_argument(
        "--repeats", type=int, default=3, help="runs per configuration; the quietest counts (default 3)"
    )
    engine.add_argument(
        "--sleep",
        action="store_true",
        help="simulate steps by sleeping instead of spinning (a cold CPU after each step)",
    )
    engine.set_defaults(func=_bench_engine)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
