"""The ``rtvideo`` command line: ``serve``, ``bench``, ``convert`` and the demo model's commands.

Every option of ``serve`` is a field of ``ServerSettings`` and can also be set
from the environment as ``RTVIDEO_<FIELD>`` (flags win); this module is the
one place that reads the environment. A command imports what it runs when it
runs, so ``rtvideo serve`` loads the server alone: no torch, nothing of
``workers``, ``bench`` or ``training`` (``tests/unit/test_import_direction.py``).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import errno
import functools
import inspect
import json
import logging
import os
import socket
import sys
import textwrap
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from rtvideo.engine.config import MODEL_DIR_PARTS, MODEL_PRESETS
from rtvideo.server.settings import GROUPS, ServerSettings

ENV_PREFIX = "RTVIDEO_"
OTHER_VARIABLES = ("RTVIDEO_ADVERTISE_HOST", "RTVIDEO_CHURN_SCRIPTS", "RTVIDEO_LOCK", "RTVIDEO_MODEL_DIR")
"""``RTVIDEO_*`` variables that are not settings, read elsewhere: a launched rank's
address (rtvideo/workers/launch.py), a test's script count, the install script's lock, the
compose file's model folder. Any other unknown one draws a warning at start."""


def _bench_engine(args: argparse.Namespace) -> int:
    from rtvideo.bench import engine as bench_engine

    options = bench_engine.BenchOptions(
        step_ms=args.step_ms,
        chunks=args.chunks,
        interactions=args.interactions,
        seed=args.seed,
        repeats=args.repeats,
        spin=not args.sleep,
    )
    return bench_engine.main(options, as_json=args.json)


def _parse_value(kind: type, text: str, optional: bool = False):
    if optional and text.lower() in ("none", "null"):
        return None
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if kind is dict:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError("expected a JSON object")
        return value
    return kind(text)


def _field_type(name: str) -> type:
    annotation = {f.name: f.type for f in fields(ServerSettings)}[name]
    for kind in (bool, int, float, dict, str):
        if kind.__name__ in str(annotation):
            return kind
    return str


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source), one line each."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.replace("``", "").split())
    return docs


def settings_from(args: argparse.Namespace, environ: dict[str, str]) -> ServerSettings:
    """Flags first, then ``RTVIDEO_*`` variables, then the defaults."""
    values = {}
    for f in fields(ServerSettings):
        flag = getattr(args, f.name, None)
        text = flag if flag is not None else environ.get(ENV_PREFIX + f.name.upper())
        if text is None:
            continue
        try:
            values[f.name] = _parse_value(_field_type(f.name), text, optional="None" in str(f.type))
        except ValueError as error:
            raise SystemExit(f"rtvideo serve: --{f.name.replace('_', '-')}: {error}") from None
    try:
        return ServerSettings(**values)
    except ValueError as error:
        raise SystemExit(f"rtvideo serve: {error}") from None


def unknown_variables(environ: dict[str, str]) -> list[str]:
    """A warning line for each ``RTVIDEO_*`` variable in ``environ`` that names no
    setting (a misspelling would otherwise be ignored silently), naming the
    closest known variable when one is close."""
    known = sorted({ENV_PREFIX + f.name.upper() for f in fields(ServerSettings)} | set(OTHER_VARIABLES))
    names = [name.removeprefix(ENV_PREFIX) for name in known]  # compared without the prefix they all share
    warnings = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known:
            continue
        close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), names, n=1, cutoff=0.6)
        hint = f"did you mean {ENV_PREFIX}{close[0]}?" if close else "rtvideo serve --help lists the settings"
        warnings.append(f"rtvideo serve: warning: {name} is not a setting, ignored; {hint}")
    return warnings


def check_model(model: str) -> None:
    """Before anything loads: ``SystemExit`` with one line when ``--model`` names
    neither a model the worker builds by name (``MODEL_PRESETS``, or a factory's
    import path ``module:function``) nor a directory with a model's folders
    (``MODEL_DIR_PARTS``). Read as ``rtvideo.server.app.pipeline_spec`` reads it: a path
    (a ``/`` in it, or an existing directory) is a model directory."""
    if "/" not in model and not Path(model).is_dir() and (model in MODEL_PRESETS or ":" in model):
        return
    parts = ", ".join(f"{part}/" for part in MODEL_DIR_PARTS)
    expected = f"expected {', '.join(MODEL_PRESETS)} or a model directory with {parts}"
    path = Path(model)
    if not path.exists():
        raise SystemExit(f"rtvideo serve: --model {model}: no such directory; {expected}")
    if not path.is_dir():
        raise SystemExit(f"rtvideo serve: --model {model}: not a directory; {expected}")
    missing = [f"{part}/" for part in MODEL_DIR_PARTS if not (path / part).is_dir()]
    if missing:
        raise SystemExit(f"rtvideo serve: --model {model}: the directory lacks {', '.join(missing)}; {expected}")


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """Bind and listen on ``host:port`` now, before anything is loaded, so a busy
    port fails in milliseconds rather than after the model has loaded.

    Listening at once (not only binding) holds the port: a second server cannot
    bind it meanwhile, and a client that connects while the model loads waits
    in the backlog and is answered once the server is up. ``SystemExit`` with
    one line naming ``host:port`` when the address cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, as asyncio binds: its accepted connections then get TCP_NODELAY (with proto 0 they
    # would not, and Nagle would hold small frames, an interaction or a chunk's metadata, for an ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may follow TIME_WAIT connections
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as error:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        why = error.strerror or str(error)
        if error.errno == errno.EADDRINUSE:
            why = "address already in use (another server is listening there; --port or RTVIDEO_PORT chooses another)"
        raise SystemExit(f"rtvideo serve: cannot listen on {where}: {why}") from None
    return sock  # not inheritable: the workers the server spawns never hold the port


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from rtvideo.server.app import create_app
    from rtvideo.server.drain import DrainingServer
    from rtvideo.server.http_protocol import MAX_HEAD_BYTES, guarded_h11
    from rtvideo.server.logs import logging_config
    from rtvideo.server.prompt_policy import PromptPolicyError, load_prompt_policy
    from rtvideo.server.startup import OneLineLifespan
    from rtvideo.server.ws_protocol import RealtimeWebSocketProtocol

    settings = settings_from(args, dict(os.environ))
    for warning in unknown_variables(dict(os.environ)):
        print(warning, file=sys.stderr)
    if settings.worker_listen is None:  # a launched group loads the model on its own machines
        check_model(settings.model)
    try:  # before anything loads; the app loads it again at start (create_app is the API's whole contract)
        load_prompt_policy(settings.prompt_policy, settings.prompt_policy_timeout_s)
    except PromptPolicyError as error:
        raise SystemExit(f"rtvideo serve: --prompt-policy {error.spec}: {error.what}") from None
    sock = listen(settings.host, settings.port)  # before the app exists: nothing loads for a port we cannot have
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=guarded_h11(settings.header_timeout_s),  # uvicorn's h11, a request's head bounded in time and size
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        ws=RealtimeWebSocketProtocol,  # uvicorn's, and a slow client can be closed without waiting on it
        ws_max_size=settings.max_message_bytes,
        # No permessage-deflate: media go uncompressed anyway (ws_protocol), and a client's
        # compressed messages would inflate past what its bytes on the wire cost it.
        ws_per_message_deflate=False,
        ws_ping_interval=None,  # liveness is the protocol's own ping and stall timeout
        log_config=logging_config(settings.log_level),  # applied here, before the app starts
        log_level=settings.log_level,
        # Sessions were drained before uvicorn stops; a request whose body stopped coming
        # is answered 408 (header_timeout_s after its last byte) before uvicorn gives up on it.
        timeout_graceful_shutdown=max(10.0, settings.header_timeout_s + 2.0),
        backlog=2048,
    )
    config.load()
    # A start that fails for a reason the app names (rtvideo/server/startup.py) ends in that one line.
    config.lifespan_class = functools.partial(
        OneLineLifespan, failure=lambda: getattr(app.state, "start_failure", None)
    )

    class ListeningServer(DrainingServer):
        """Serves on the socket bound above, and still says where it listens
        (uvicorn logs "Uvicorn running on ..." only for sockets it bound itself);
        with ``--port 0`` under a log level that hides that line, the port chosen
        is printed on stderr all the same: nobody could reach the server otherwise."""

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and sockets:
                self._log_started_message(sockets)
                if settings.port == 0 and not logging.getLogger("uvicorn.error").isEnabledFor(logging.INFO):
                    host = f"[{settings.host}]" if ":" in settings.host else settings.host
                    port = sockets[0].getsockname()[1]
                    print(f"rtvideo serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)

    server = ListeningServer(config, drain=lambda: app.state.drainer.drain())
    server.run(sockets=[sock])
    return 0 if server.started else 1


def _max_lead(text: str) -> float | str | None:
    """``bench realtime --max-lead``: ``adaptive``, ``off`` (None) or seconds > 0."""
    if text in ("adaptive", "off"):
        return None if text == "off" else text
    return _positive_seconds(text, "adaptive, off or ")


def _positive_seconds(text: str, others: str = "", unit: str = "seconds") -> float:
    """A finite number of seconds (or ``unit``) > 0, for an option (``others``:
    what else it takes, for the error)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected {others}a number of {unit} > 0")
    return seconds


def _positive_minutes(text: str) -> float:
    return _positive_seconds(text, unit="minutes")


def _realtime_url(given: str) -> str:
    """A bench's ``--url`` (http(s):// or ws(s)://, with or without the path) as the realtime socket's URL."""
    url = given if given.endswith("/v1/realtime/video") else given.rstrip("/") + "/v1/realtime/video"
    return url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)


def _bench_realtime(args: argparse.Namespace) -> int:
    from rtvideo.bench import realtime as bench_realtime

    url = _realtime_url(args.url)
    options = bench_realtime.RealtimeBenchOptions(
        url=url,
        sessions=args.sessions,
        chunks=args.chunks,
        interact_at=args.interact_at,
        interact_every=args.interact_every,
        max_lead_seconds=args.max_lead,
        api_key=args.api_key,
        stall_timeout_s=args.stall_timeout,
    )
    return bench_realtime.main(options, as_json=args.json)


def _bench_options(name: str, make: Callable[..., Any], **fields: Any) -> Any:
    """``make(**fields)``: a bench's options; one out of range ends the command, naming it."""
    try:
        return make(**fields)
    except ValueError as error:
        raise SystemExit(f"rtvideo bench {name}: {error}") from None


def _bench_soak(args: argparse.Namespace) -> int:
    from rtvideo.bench import soak as bench_soak

    options = _bench_options(
        "soak",
        bench_soak.SoakOptions,
        url=_realtime_url(args.url),
        minutes=args.minutes,
        rounds=args.rounds,
        chunks=args.chunks,
        concurrency=args.concurrency,
        warm_up_rounds=args.warm_up_rounds,
        max_growth_mib=args.max_growth_mib,
        max_fd_growth=args.max_fd_growth,
        api_key=args.api_key,
        stall_timeout_s=args.stall_timeout,
        seed=args.seed,
    )
    return bench_soak.main(options, as_json=args.json)


def _bench_v2v(args: argparse.Namespace) -> int:
    from rtvideo.bench import v2v as bench_v2v

    options = _bench_options(
        "v2v",
        bench_v2v.V2vBenchOptions,
        url=_realtime_url(args.url),
        sessions=args.sessions,
        chunks=args.chunks,
        strength=args.strength,
        format=args.format,
        width=args.width,
        height=args.height,
        fps=args.fps,
        interact_at=args.interact_at,
        api_key=args.api_key,
        stall_timeout_s=args.stall_timeout,
    )
    return bench_v2v.main(options, as_json=args.json)


def _bench_pp(args: argparse.Namespace) -> int:
    from rtvideo.bench import pp as bench_pp

    options = bench_pp.PpBenchOptions(
        model=args.model, chunks=args.chunks, size=args.size, steps=args.steps, repeats=args.repeats
    )
    try:
        configs = bench_pp.CONFIGS if args.only is None else bench_pp.select(args.only)
    except ValueError as error:
        raise SystemExit(f"rtvideo bench pp: {error}") from None
    return bench_pp.main(options, as_json=args.json, configs=configs, sized_as=bench_pp.CONFIGS)


def _bench_pipeline(args: argparse.Namespace) -> int:
    from rtvideo.bench import pipeline  # it runs the model (torch) in this process; it parses its own options

    return pipeline.main(args.rest)


def _convert(args: argparse.Namespace) -> int:
    from rtvideo.workers import convert  # conversion needs torch, imported for this command only

    return convert.main(args.rest)


def _train_demo(args: argparse.Namespace) -> int:
    from rtvideo.training.demo import (
        train,  # training runs the model (torch) in this process; it parses its own options
    )

    return train.main(args.rest)


def _eval_demo(args: argparse.Namespace) -> int:
    from rtvideo.training.demo import evaluate  # the evaluation runs the served pipeline in this process

    return evaluate.main(args.rest)


def _refine_demo_decoder(args: argparse.Namespace) -> int:
    from rtvideo.training.demo import refine  # the refiner trains (torch) in this process

    return refine.main(args.rest)


def _server_bench(benches: argparse._SubParsersAction, name: str, about: str, sessions: int) -> argparse.ArgumentParser:
    """The parser of ``bench NAME``, a bench of WebSocket sessions against a running
    server, with the options every such bench takes: the server, how many
    sessions and chunks, its API key and ``--json``."""
    bench = benches.add_parser(name, help=about)
    bench.add_argument("--url", default="ws://127.0.0.1:8000", help="the server (http(s):// or ws(s)://)")
    bench.add_argument("--sessions", type=int, default=sessions, help=f"concurrent sessions (default {sessions})")
    bench.add_argument("--chunks", type=int, default=12, help="chunks per session (default 12)")
    bench.add_argument("--api-key", default=None)
    bench.add_argument(
        "--stall-timeout",
        type=_positive_seconds,
        default=120.0,
        help="a session that hears nothing from the server for this many seconds fails (default 120)",
    )
    bench.add_argument("--json", action="store_true", help="print only the JSON summary")
    return bench


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rtvideo", description="Realtime video generation server.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve",
        help="run the server (each option also reads RTVIDEO_<NAME>)",
        usage="%(prog)s [-h] [--OPTION VALUE ...]",  # the options, grouped, below
        description="Run the server. Every option can also be set as the environment variable RTVIDEO_<NAME> "
        "(for example RTVIDEO_PORT=9000); a flag wins over the variable. The options, by what they are about: "
        + ", ".join(GROUPS)
        + ".",
    )
    docs = field_docs(ServerSettings)
    sections = {name: serve.add_argument_group(name, about) for name, about in GROUPS.items()}
    for f in fields(ServerSettings):
        default = f.default if f.default is not MISSING else f.default_factory()
        text = docs.get(f.name, "").replace("%", "%%")
        sections[f.metadata["group"]].add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            default=None,
            metavar=_field_type(f.name).__name__.upper(),
            help=f"{text} (default: {default!r}; env RTVIDEO_{f.name.upper()})".lstrip(),
        )
    serve.set_defaults(func=_serve)

    convert = commands.add_parser(
        "convert", help="a Self-Forcing checkpoint into a model directory's transformer/", add_help=False
    )
    convert.set_defaults(func=_convert, passthrough=True)

    train_demo = commands.add_parser(
        "train-demo", help="train the demo model on synthetic scenes (resumable; --help for options)", add_help=False
    )
    train_demo.set_defaults(func=_train_demo, passthrough=True)
    eval_demo = commands.add_parser(
        "eval-demo", help="judge a demo model's chunks against their prompts (JSON last line)", add_help=False
    )
    eval_demo.set_defaults(func=_eval_demo, passthrough=True)
    refine = commands.add_parser(
        "refine-demo-decoder",
        help="train a demo model's causal decoder refiner and write it into the model directory",
        add_help=False,
    )
    refine.set_defaults(func=_refine_demo_decoder, passthrough=True)

    bench = commands.add_parser("bench", help="benchmarks; each prints a JSON summary as its last line")
    benches = bench.add_subparsers(dest="bench", required=True)
    pipeline = benches.add_parser("pipeline", help="the causal Wan pipeline's cost per chunk", add_help=False)
    pipeline.set_defaults(func=_bench_pipeline, passthrough=True)
    realtime = _server_bench(benches, "realtime", "K concurrent WebSocket sessions against a running server", 4)
    realtime.add_argument(
        "--interact-at", type=int, default=3, help="send a new prompt within a chunk period after this chunk"
    )
    realtime.add_argument(
        "--interact-every", type=int, default=0, help="and again every N chunks after it (default 0: once)"
    )
    realtime.add_argument(
        "--max-lead",
        type=_max_lead,
        default="adaptive",
        help="pacing: 'adaptive' (the page's buffer policy, the default), a fixed budget in seconds, or 'off'",
    )
    realtime.set_defaults(func=_bench_realtime)
    v2v = _server_bench(benches, "v2v", "K concurrent video-to-video sessions (frames in, restyled chunks out)", 1)
    v2v.add_argument("--strength", type=float, default=0.6, help="input.strength, 0-1 (default 0.6)")
    v2v.add_argument("--format", choices=("jpeg", "raw"), default="jpeg", help="how input frames travel")
    v2v.add_argument("--width", type=int, default=None, help="input width (default: the model's)")
    v2v.add_argument("--height", type=int, default=None, help="input height (default: the model's)")
    v2v.add_argument("--fps", type=float, default=None, help="input frame rate (default: the model's)")
    v2v.add_argument("--interact-at", type=int, default=3, help="send a new prompt once this chunk arrived")
    v2v.set_defaults(func=_bench_v2v)
    soak = benches.add_parser(
        "soak", help="a running server taken round after round through every serving path; its memory and files watched"
    )
    soak.add_argument("--url", default="ws://127.0.0.1:8000", help="the server (http(s):// or ws(s)://)")
    soak.add_argument("--minutes", type=_positive_minutes, default=10.0, help="begin rounds for this long (default 10)")
    soak.add_argument("--rounds", type=int, default=None, help="or stop after this many rounds")
    soak.add_argument("--chunks", type=int, default=3, help="chunks of a finite session or job (default 3)")
    soak.add_argument("--concurrency", type=int, default=2, help="sessions or jobs of a round at once (default 2)")
    soak.add_argument("--warm-up-rounds", type=int, default=3, help="rounds before growth counts (default 3)")
    soak.add_argument(
        "--max-growth-mib",
        type=float,
        default=8.0,
        help="resident memory a process may gain over the second half of the rounds before it counts as a leak "
        "(default 8)",
    )
    soak.add_argument(
        "--max-fd-growth",
        type=int,
        default=4,
        help="open files an idle process may gain over the second half of the rounds (default 4)",
    )
    soak.add_argument("--api-key", default=None)
    soak.add_argument(
        "--stall-timeout",
        type=_positive_seconds,
        default=60.0,
        help="a session that hears nothing, or a job not done, for this many seconds fails (default 60)",
    )
    soak.add_argument("--seed", type=int, default=0, help="the order of each round's paths")
    soak.add_argument("--json", action="store_true", help="print only the JSON summary")
    soak.set_defaults(func=_bench_soak)
    pp = benches.add_parser("pp", help="temporal pipeline parallelism: 1 vs 2 ranks, 1 and 4 sessions, batching")
    pp.add_argument("--model", default="tiny", help="tiny, or a model directory")
    pp.add_argument("--chunks", type=int, default=6, help="chunks per session of four (one session runs 4x as many)")
    pp.add_argument("--size", type=int, default=64, help="frame width and height")
    pp.add_argument("--steps", type=int, default=4, help="denoise steps per chunk")
    pp.add_argument(
        "--repeats", type=int, default=1, help="rounds of every configuration; each ratio is the rounds' median"
    )
    pp.add_argument(
        "--only",
        default=None,
        metavar="NAMES",
        help="run only these configurations, comma-separated NAME or NAME@SESSIONS "
        "(e.g. pp1-1t@1,pp2-stream@1); sessions make as many chunks as in a full run",
    )
    pp.add_argument("--json", action="store_true", help="print only the JSON summary")
    pp.set_defaults(func=_bench_pp)
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
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        args.rest = rest  # parsed by the command itself, in its own module
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
