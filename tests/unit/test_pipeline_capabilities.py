"""A pipeline's optional parts are declared (``capabilities``) and checked once,
when the worker builds it (``build_pipeline``, by registered name or import
path alike): one that declares a part it does not implement, or lacks a
``ChunkPipeline`` member, is refused with an error naming the pipeline and
the method. The stub declares video input only, and passes."""

from __future__ import annotations

import dataclasses

import pytest

from rtvideo.engine.config import PipelineSpec
from rtvideo.engine.messages import StartSession, VideoInput
from rtvideo.workers.pipelines import build_pipeline
from rtvideo.workers.pipelines.capabilities import PROTOCOLS, Capabilities, PipelineContractError, check_pipeline
from rtvideo.workers.pipelines.stub import StubPipeline
from rtvideo.workers.runner import ModelRunner

HERE = "tests.unit.test_pipeline_capabilities"


def implemented(pipeline) -> set[str]:
    """The capabilities whose every member ``pipeline`` has (what it could declare)."""
    found = set()
    for name, protocol in PROTOCOLS.items():
        members = [m for m in vars(protocol) if not m.startswith("_")] + list(vars(protocol).get("__annotations__", {}))
        if all(hasattr(pipeline, member) for member in members):
            found.add(name)
    return found


class DeclaresDecodeBatch(StubPipeline):
    """Says it decodes batches, but has no ``decode_batch``."""

    capabilities = Capabilities(decode_batch=True)


class WrongDecodeBatch(StubPipeline):
    """Has a ``decode_batch`` that takes one argument where the runner passes two."""

    capabilities = Capabilities(decode_batch=True)

    def decode_batch(self, sessions):
        return [self.decode(session, 0) for session in sessions]


class SplitWithoutRankDecode(StubPipeline):
    """Declares the decoder split over ranks without the decode on another rank it builds on."""

    capabilities = Capabilities(split_decode=True)


class NoLimits:
    """Everything the stub has but ``limits``."""

    def __init__(self, **options) -> None:
        self._stub = StubPipeline(**options)

    def __getattr__(self, name: str):
        if name == "limits":
            raise AttributeError(name)
        return getattr(self._stub, name)


def declares_decode_batch(**options) -> StubPipeline:
    return DeclaresDecodeBatch(**options)


def no_limits(**options) -> NoLimits:
    return NoLimits(**options)


def test_the_stub_declares_only_what_it_implements_and_passes():
    stub = build_pipeline(PipelineSpec("stub", {}), 2)
    assert stub.capabilities == Capabilities(video_input=True)
    assert set(stub.capabilities.declared()) == implemented(stub) == {"video_input"}
    assert check_pipeline(StubPipeline()) is not None


def test_a_start_with_an_input_is_refused_where_the_pipeline_does_not_declare_video_input():
    class TextOnly(StubPipeline):
        capabilities = Capabilities()

    start = StartSession(
        session_id="s", prompt="p", input=VideoInput(strength=0.5, format="raw", width=32, height=32, fps=16.0)
    )
    with pytest.raises(ValueError, match=r"^input: the 'stub' pipeline takes no input video \(it does not declare "):
        ModelRunner(TextOnly()).describe(start)
    assert ModelRunner(StubPipeline()).describe(start).num_inference_steps == 2  # half of its 4 steps


def test_a_pipeline_by_import_path_declaring_a_method_it_lacks_is_refused_at_build():
    with pytest.raises(PipelineContractError) as refused:
        build_pipeline(PipelineSpec(f"{HERE}:declares_decode_batch", {}), 2)
    message = str(refused.value)
    assert "DeclaresDecodeBatch" in message and "'stub'" in message
    assert "declares decode_batch: it has no method decode_batch(sessions, chunk_indices)" in message


def test_a_declared_method_that_does_not_take_the_protocol_arguments_is_refused():
    with pytest.raises(PipelineContractError, match=r"decode_batch: its decode_batch\(sessions\) does not take"):
        check_pipeline(WrongDecodeBatch())


def test_a_capability_without_the_one_it_builds_on_is_refused():
    with pytest.raises(PipelineContractError, match="declares split_decode but not rank_decode"):
        check_pipeline(SplitWithoutRankDecode())


def test_a_pipeline_missing_a_contract_method_is_refused_naming_it():
    with pytest.raises(PipelineContractError, match=r"is not a ChunkPipeline: it has no method limits\(\)"):
        build_pipeline(PipelineSpec(f"{HERE}:no_limits", {}), 2)


def test_capabilities_must_be_declared_as_such():
    class Loose(StubPipeline):
        capabilities = {"decode_batch"}

    with pytest.raises(PipelineContractError, match="capabilities must be a"):
        check_pipeline(Loose())


def test_every_capability_has_its_protocol():
    assert {f.name for f in dataclasses.fields(Capabilities)} == set(PROTOCOLS)


def fails_inside(**options) -> StubPipeline:
    """A factory whose own code makes a call with a keyword its callee lacks."""
    return StubPipeline(**options, no_such_keyword=1)


def test_an_option_the_pipeline_does_not_take_is_refused_by_name_and_a_bug_inside_it_is_not_disguised():
    with pytest.raises(ValueError, match=r"^pipeline 'stub' takes no option 'colour' \(set by --pipeline-options\)$"):
        build_pipeline(PipelineSpec("stub", {"colour": "red"}), 2)
    with pytest.raises(ValueError, match=r"takes no option 'quantize' \(set by --quantize or --pipeline-options\)"):
        build_pipeline(PipelineSpec("stub", {"quantize": "fp8"}), 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_keyword'"):
        build_pipeline(PipelineSpec(f"{HERE}:fails_inside", {"width": 32}), 2)


def test_a_default_session_the_model_cannot_serve_is_refused_at_build_naming_the_field():
    whose = r"^the default session of pipeline 'stub': "
    with pytest.raises(ValueError, match=whose + r"fps must be between 1 and 120, got 0$"):
        build_pipeline(PipelineSpec("stub", {"fps": 0}), 2)
    with pytest.raises(ValueError, match=whose + r"frames_per_chunk must be >= 1, got 0$"):
        build_pipeline(PipelineSpec("stub", {"frames_per_chunk": 0, "first_chunk_frames": 4}), 2)
    with pytest.raises(ValueError, match=r"takes no option 'decoder' \(set by --decoder or --pipeline-options\)"):
        build_pipeline(PipelineSpec("stub", {"decoder": "tiny"}), 2)
