"""``rtvideo serve`` options: flags, then RTVIDEO_* variables, then defaults."""

from __future__ import annotations

import pytest

from rtvideo.cli.main import build_parser, settings_from


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_serve_the_demo_model_on_localhost():
    settings = settings_from(parse(), {})
    assert (settings.model, settings.host, settings.port, settings.api_key) == ("demo", "127.0.0.1", 8000, None)


def test_environment_then_flags():
    env = {"RTVIDEO_MAX_SESSIONS": "7", "RTVIDEO_API_KEY": "k", "RTVIDEO_GROUP_CHUNK_STEPS": "false"}
    settings = settings_from(parse("--max-sessions", "9", "--pipeline-options", '{"step_time_s": 0.5}'), env)
    assert settings.max_sessions == 9  # the flag wins
    assert settings.api_key == "k" and settings.group_chunk_steps is False
    assert settings.pipeline_options == {"step_time_s": 0.5}


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (("--max-sessions", "many"), {}, "max-sessions"),
        ((), {"RTVIDEO_PORT": "70000"}, "port"),
        (("--stall-timeout-s", "0"), {}, "stall_timeout_s"),
        (("--pipeline-options", "[1]"), {}, "pipeline-options"),
        ((), {"RTVIDEO_GROUP_CHUNK_STEPS": "maybe"}, "group-chunk-steps"),
        (("--session-memory-gib", "0"), {}, "session_memory_gib"),
        (("--session-memory-gib", "inf"), {}, "session_memory_gib must be a finite number, got inf"),
        ((), {"RTVIDEO_SLO_FIRST_CHUNK_S": "nan"}, "slo_first_chunk_s must be a finite number, got nan"),
        ((), {"RTVIDEO_MAX_REALTIME_LOAD": "-inf"}, "max_realtime_load must be a finite number"),
        ((), {"RTVIDEO_HOST": ""}, "host must not be empty"),  # '' would bind every interface
        (("--host", ""), {}, "host must not be empty"),
        (("--worker-listen", "abc"), {}, "worker_listen must look like HOST:PORT"),  # one line, not a traceback
    ],
)
def test_bad_values_exit_naming_the_option(argv, env, names):
    with pytest.raises(SystemExit, match=names):
        settings_from(parse(*argv), env)


def test_a_variable_that_names_no_setting_is_warned_of_with_the_closest_one():
    from rtvideo.cli.main import unknown_variables

    environ = {"RTVIDEO_MAX_SESION": "3", "RTVIDEO_PORT": "90", "RTVIDEO_LOCK": "cpu", "PATH": "/", "RTVIDEO_XYZZY": ""}
    assert unknown_variables(environ) == [
        "rtvideo serve: warning: RTVIDEO_MAX_SESION is not a setting, ignored; did you mean RTVIDEO_MAX_SESSIONS?",
        "rtvideo serve: warning: RTVIDEO_XYZZY is not a setting, ignored; rtvideo serve --help lists the settings",
    ]


def test_a_model_that_is_neither_a_preset_nor_a_model_directory_is_refused_in_one_line(tmp_path):
    from rtvideo.cli.main import check_model
    from rtvideo.engine.config import MODEL_DIR_PARTS, MODEL_PRESETS
    from rtvideo.workers.pipelines import REGISTRY  # torch-free: the worker's names, read lazily

    assert set(MODEL_PRESETS) <= set(REGISTRY)
    for name in (*MODEL_PRESETS, "my_package.models:build"):
        check_model(name)  # built by the worker, by name
    expected = "expected demo, tiny, stub or a model directory with transformer/, vae/, text_encoder/, tokenizer/"
    with pytest.raises(SystemExit, match=f"^rtvideo serve: --model {tmp_path}/x: no such directory; {expected}$"):
        check_model(str(tmp_path / "x"))
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="--model .*/file: not a directory"):
        check_model(str(tmp_path / "file"))
    (tmp_path / "vae").mkdir()
    with pytest.raises(SystemExit, match="the directory lacks transformer/, text_encoder/, tokenizer/;"):
        check_model(str(tmp_path))
    for part in MODEL_DIR_PARTS:
        (tmp_path / part).mkdir(exist_ok=True)
    check_model(str(tmp_path))  # what the folders hold is the worker's to read


def test_engine_options_reach_the_engine_config():
    from rtvideo.server.app import engine_config

    settings = settings_from(parse("--max-batch-rows", "3", "--pipeline-options", '{"dtype": "bfloat16"}'), {})
    config = engine_config(settings)
    assert config.max_batch_rows == 3 and config.group_chunk_steps is True
    assert config.pipeline.name == "demo" and config.pipeline.options == {"dtype": "bfloat16"}
    assert engine_config(settings_from(parse(), {})).max_batch_rows == 1
    assert engine_config(settings_from(parse(), {})).session_memory_bytes is None
    assert engine_config(settings_from(parse(), {"RTVIDEO_SESSION_MEMORY_GIB": "1.5"})).session_memory_bytes == 3 << 29
    with pytest.raises(SystemExit, match="max_batch_rows"):
        settings_from(parse("--max-batch-rows", "0"), {})


def test_the_cpu_thread_count_is_measured_unless_given():
    from rtvideo.server.app import engine_config

    assert engine_config(settings_from(parse(), {})).cpu_threads is None  # the worker measures it
    assert engine_config(settings_from(parse("--cpu-threads", "3"), {})).cpu_threads == 3
    assert engine_config(settings_from(parse(), {"RTVIDEO_CPU_THREADS": "2"})).cpu_threads == 2
    with pytest.raises(SystemExit, match="cpu_threads must be > 0"):
        settings_from(parse("--cpu-threads", "0"), {})


def test_frame_area_and_realtime_load_reach_the_engine_and_none_turns_the_check_off():
    from rtvideo.server.app import engine_config

    default = engine_config(settings_from(parse(), {}))
    assert (default.max_pixels, default.max_realtime_load) == (None, 0.9)  # derived by the worker; checked
    config = engine_config(settings_from(parse("--max-pixels", "65536", "--max-realtime-load", "none"), {}))
    assert (config.max_pixels, config.max_realtime_load) == (65536, None)
    assert engine_config(settings_from(parse(), {"RTVIDEO_MAX_REALTIME_LOAD": "0.5"})).max_realtime_load == 0.5
    with pytest.raises(SystemExit, match="max_realtime_load"):
        settings_from(parse("--max-realtime-load", "0"), {})


def test_serve_help_explains_every_option():
    from dataclasses import fields

    from rtvideo.cli.main import build_parser, field_docs
    from rtvideo.server.settings import ServerSettings

    docs = field_docs(ServerSettings)
    assert [f.name for f in fields(ServerSettings) if not docs.get(f.name)] == [], "an option without a description"
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    for f in fields(ServerSettings):
        assert f"--{f.name.replace('_', '-')}" in text and f"RTVIDEO_{f.name.upper()}" in text
    assert "JSON object" in text and "tiny" in text and "``" not in text


def test_serve_help_lists_every_option_in_exactly_one_group_of_its_fields_naming():
    from dataclasses import fields

    from rtvideo.server.settings import GROUPS, ServerSettings, setting

    assert [f.name for f in fields(ServerSettings) if f.metadata.get("group") not in GROUPS] == []
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    listed: dict[str, list[str]] = {}
    for group in serve._action_groups:
        for action in group._group_actions:
            listed.setdefault(action.dest, []).append(group.title)
    for f in fields(ServerSettings):
        assert listed[f.name] == [f.metadata["group"]], f.name  # in its own group, and only there
    assert [group.title for group in serve._action_groups][-len(GROUPS) :] == list(GROUPS)
    text = serve.format_help()
    positions = [text.index(f"\n{title}:\n") for title in GROUPS]  # each title heads its section, in order
    assert positions == sorted(positions)
    assert text.index("\ncapacity:\n") < text.index("--max-sessions") < text.index("\nsessions:\n")
    assert text.startswith("usage: rtvideo serve [-h] [--OPTION VALUE ...]\n")
    with pytest.raises(ValueError, match="setting group must be one of network, model"):
        setting("misc", 1)


def test_stream_batch_options_reach_the_engine_config_and_need_ranks():
    from rtvideo.server.app import engine_config

    argv = ("--pp", "2", "--stream-batch", "true", "--max-chunks-in-flight", "3")
    config = engine_config(settings_from(parse(*argv), {}))
    assert config.stream_batch is True and config.max_chunks_in_flight == 3
    assert config.lookahead("soft") == 3 and config.lookahead("reset") == 1
    assert engine_config(settings_from(parse("--pp", "2"), {})).lookahead("soft") == 1
    with pytest.raises(SystemExit, match="stream_batch needs pp >= 2"):
        settings_from(parse("--stream-batch", "true"), {})


def test_the_ranks_transport_reaches_the_engine_config_and_anything_else_is_refused_by_name():
    from rtvideo.engine.config import EngineConfig, PipelineSpec
    from rtvideo.server.app import engine_config

    assert engine_config(settings_from(parse("--pp", "2"), {})).pp_transport == "auto"
    config = engine_config(settings_from(parse("--pp", "2"), {"RTVIDEO_PP_TRANSPORT": "torch"}))
    assert config.pp_transport == "torch"
    with pytest.raises(SystemExit, match="pp_transport must be auto or torch, got 'zmq'"):
        settings_from(parse("--pp-transport", "zmq"), {})
    with pytest.raises(ValueError, match="pp_transport must be one of auto, torch"):
        EngineConfig(pipeline=PipelineSpec("tiny", {}), pp_transport="gloo")


def test_the_ranks_ports_reach_the_engine_config_and_a_range_past_65535_is_refused_by_name():
    from rtvideo.engine.config import EngineConfig, PipelineSpec
    from rtvideo.server.app import engine_config

    assert engine_config(settings_from(parse("--pp", "2"), {})).pp_port is None
    assert engine_config(settings_from(parse("--pp", "2", "--pp-port", "29600"), {})).pp_port == 29600
    with pytest.raises(SystemExit, match="pp_port must leave room for 2 ports: 1 to 65534, got 65535"):
        settings_from(parse("--pp", "2", "--pp-port", "65535"), {})
    with pytest.raises(ValueError, match="pp_port must leave room for 4 ports"):
        EngineConfig(pipeline=PipelineSpec("tiny", {}), pp=4, pp_port=65533)


def test_where_the_ranks_decode_reaches_the_engine_config_and_anything_else_is_refused_by_name():
    from rtvideo.engine.config import EngineConfig, PipelineSpec
    from rtvideo.server.app import engine_config

    assert engine_config(settings_from(parse("--pp", "2"), {})).pp_decode == "auto"
    assert engine_config(settings_from(parse("--pp", "2", "--pp-decode", "first"), {})).pp_decode == "first"
    config = engine_config(settings_from(parse("--pp", "2"), {"RTVIDEO_PP_DECODE": "spread"}))
    assert config.pp_decode == "spread"
    assert engine_config(settings_from(parse("--pp", "2", "--pp-decode", "split"), {})).pp_decode == "split"
    with pytest.raises(SystemExit, match="pp_decode must be one of auto, first, spread, split, got 'last'"):
        settings_from(parse("--pp-decode", "last"), {})
    with pytest.raises(ValueError, match="pp_decode must be one of auto, first, spread, split"):
        EngineConfig(pipeline=PipelineSpec("tiny", {}), pp_decode="all")


def test_the_decode_threads_nice_reaches_the_engine_config_and_a_value_out_of_range_is_refused_by_name():
    from rtvideo.engine.config import EngineConfig, PipelineSpec
    from rtvideo.server.app import engine_config

    assert engine_config(settings_from(parse(), {})).decode_nice is None
    assert engine_config(settings_from(parse("--decode-nice", "0"), {})).decode_nice == 0
    assert engine_config(settings_from(parse(), {"RTVIDEO_DECODE_NICE": "19"})).decode_nice == 19
    with pytest.raises(SystemExit, match="decode_nice must be 0 to 19, got 20"):
        settings_from(parse("--decode-nice", "20"), {})
    with pytest.raises(SystemExit, match="decode_nice must be 0 to 19, got -1"):
        settings_from(parse("--decode-nice", "-1"), {})
    with pytest.raises(ValueError, match="EngineConfig.decode_nice must be 0 to 19"):
        EngineConfig(pipeline=PipelineSpec("tiny", {}), decode_nice=25)


def test_the_log_level_reaches_the_workers_and_anything_else_is_refused_by_name():
    from rtvideo.engine.config import EngineConfig, PipelineSpec
    from rtvideo.server.app import engine_config
    from rtvideo.server.logs import logging_config

    assert engine_config(settings_from(parse(), {})).log_level == "info"
    assert engine_config(settings_from(parse("--log-level", "debug"), {})).log_level == "debug"
    assert engine_config(settings_from(parse(), {"RTVIDEO_LOG_LEVEL": "warning"})).log_level == "warning"
    with pytest.raises(SystemExit, match="log_level must be one of critical, error, warning, info, debug, got 'loud'"):
        settings_from(parse("--log-level", "loud"), {})
    with pytest.raises(ValueError, match="EngineConfig.log_level must be one of"):
        EngineConfig(pipeline=PipelineSpec("tiny", {}), log_level="INFO")
    with pytest.raises(ValueError, match="log level must be one of"):
        logging_config("verbose")


def test_the_api_process_logs_its_own_lines_at_the_level_and_other_libraries_only_their_warnings(capsys):
    import logging
    import logging.config

    from rtvideo.server.logs import logging_config

    root = logging.getLogger()
    named = [
        logging.getLogger(name)
        for name in (
            "rtvideo.server",
            "rtvideo.engine",
            "uvicorn",
            "uvicorn.error",
            "uvicorn.access",
            "python_multipart",
        )
    ]
    saved = root.handlers[:], root.level, [(one, one.handlers[:], one.level, one.propagate) for one in named]
    try:
        logging.config.dictConfig(logging_config("debug"))
        logging.getLogger("rtvideo.server.live_session").debug("session s1 resumed")
        logging.getLogger("rtvideo.engine.client.engine_client").info("worker is ready")
        logging.getLogger("httpx").info("a dependency's detail")
        logging.getLogger("httpx").warning("a dependency's warning")
        logging.getLogger("python_multipart.multipart").warning("Expected boundary character")  # a client's 422
        logging.config.dictConfig(logging_config("warning"))
        logging.getLogger("rtvideo.server.drain").info("draining: 0 sessions open")
        logging.getLogger("rtvideo.server.jobs").warning("job j1 failed")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        for one, handlers, level, propagate in saved[2]:  # nothing left writing to this test's captured stderr
            one.handlers[:], one.level, one.propagate = handlers, level, propagate
    lines = capsys.readouterr().err.splitlines()
    said = [line.split(" ", 2)[2] for line in lines]  # past the date and the time
    assert said == [
        "api DEBUG session s1 resumed",
        "api INFO worker is ready",
        "api WARNING a dependency's warning",
        "api WARNING job j1 failed",
    ], lines


@pytest.mark.parametrize(
    ("bench", "module", "options"),
    [
        ("realtime", "rtvideo.bench.realtime", "RealtimeBenchOptions"),
        ("v2v", "rtvideo.bench.v2v", "V2vBenchOptions"),
        ("soak", "rtvideo.bench.soak", "SoakOptions"),
    ],
)
def test_a_server_bench_flag_left_out_means_the_bench_options_own_default(bench, module, options):
    """The CLI does not import a bench to parse its flags, so each flag writes
    its default out; it must be the options' own (``--stall-timeout`` is
    ``stall_timeout_s``, ``--max-lead`` ``max_lead_seconds``)."""
    import dataclasses
    import importlib

    args = build_parser().parse_args(["bench", bench])
    renamed = {"stall_timeout_s": "stall_timeout", "max_lead_seconds": "max_lead"}
    compared = []
    for field in dataclasses.fields(getattr(importlib.import_module(module), options)):
        flag = renamed.get(field.name, field.name)
        if field.default is dataclasses.MISSING or not hasattr(args, flag):
            continue
        assert getattr(args, flag) == field.default, f"bench {bench} --{flag.replace('_', '-')}"
        compared.append(field.name)
    assert "stall_timeout_s" in compared and "chunks" in compared, compared
