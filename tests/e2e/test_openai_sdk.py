"""The official OpenAI Python SDK (``openai``) against ``/v1/videos`` of a real
``rtvideo serve``: create (multipart form), retrieve, list page by page,
download, delete and create_and_poll, each answer parsed by the SDK's own
types, and refusals raised as the SDK's errors naming the field."""

from __future__ import annotations

import io

import av
import openai
import pytest
from openai.types import Video, VideoDeleteResponse

from tests.e2e.conftest import start_server, stop_server

KEY = "sdk-key"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK marks its videos API deprecated


@pytest.fixture(scope="module")
def client():
    server = start_server("--api-key", KEY, pipeline={"step_time_s": 0.002})
    # No retries: a refusal is the answer under test, not something to retry.
    yield openai.OpenAI(base_url=server.http + "/v1", api_key=KEY, max_retries=0, timeout=60)
    stop_server(server)


def conforms(video: Video) -> None:
    """Every field of the SDK's Video validates strictly, but ``size``: the SDK's
    type lists Sora's sizes only; ours is the served model's WIDTHxHEIGHT."""
    answer = video.model_dump()
    Video.model_validate({**answer, "size": "720x1280"}, strict=True)
    assert video.status in ("queued", "in_progress", "completed", "failed")
    assert 0 <= video.progress <= 100 and isinstance(video.created_at, int)


def test_create_poll_download_and_delete(client):
    created = client.videos.create(prompt="a paper boat", model="stub", seconds="1", size="32x32")
    conforms(created)
    assert (created.object, created.model, created.seconds, created.size) == ("video", "stub", "1", "32x32")
    assert created.prompt == "a paper boat" and created.expires_at is None
    done = client.videos.poll(created.id, poll_interval_ms=20)
    conforms(done)
    assert done.status == "completed" and done.progress == 100 and done.error is None
    assert done.completed_at >= done.created_at and done.expires_at == done.completed_at + 3600
    assert client.videos.retrieve(created.id).model_dump() == done.model_dump()

    content = client.videos.download_content(created.id).content
    assert content == client.videos.download_content(created.id, variant="video").content
    with av.open(io.BytesIO(content)) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 16 and (frames[0].width, frames[0].height) == (32, 32)  # 1 s at the stub's 16 fps
    with pytest.raises(openai.UnprocessableEntityError, match="variant"):
        client.videos.download_content(created.id, variant="thumbnail")

    deleted = client.videos.delete(created.id)
    assert isinstance(deleted, VideoDeleteResponse)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "video.deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(created.id)


def test_create_and_poll(client):
    video = client.videos.create_and_poll(prompt="a storm", model="stub", seconds="1", poll_interval_ms=20)
    conforms(video)
    assert video.status == "completed" and video.size == "32x32"  # the stub's default size
    assert len(client.videos.download_content(video.id).content) > 0
    client.videos.delete(video.id)


def test_create_without_seconds_is_four_seconds(client):
    """``videos.create(prompt=...)`` alone: 4 s, the OpenAI API's default."""
    video = client.videos.create_and_poll(prompt="a lighthouse", poll_interval_ms=20)
    conforms(video)
    assert video.status == "completed" and video.seconds == "4"
    with av.open(io.BytesIO(client.videos.download_content(video.id).content)) as container:
        assert len(list(container.decode(video=0))) == 64  # 4 s at the stub's 16 fps
    client.videos.delete(video.id)


def test_list_pages_through_every_job(client):
    mine = [client.videos.create(prompt=f"scene {i}", seconds="1", size="32x32").id for i in range(3)]
    first = client.videos.list(limit=2)
    assert [v.id for v in first.data] == mine[::-1][:2] and first.has_more
    assert first.last_id == mine[1] and first.has_next_page()
    second = first.get_next_page()  # after=last_id, as the SDK sends it
    assert second.data[0].id == mine[0]
    everything = [v.id for v in client.videos.list(limit=2)]  # auto-paging: every page, newest first
    assert [i for i in everything if i in mine] == mine[::-1]
    oldest = [v.id for v in client.videos.list(limit=1, order="asc")]
    assert [i for i in oldest if i in mine] == mine
    for video in client.videos.list(limit=100):
        conforms(video)
    for video_id in mine:
        client.videos.delete(video_id)
    with pytest.raises(openai.UnprocessableEntityError, match="after"):
        client.videos.list(after=mine[0])  # deleted: no such cursor


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"input_reference": ("ref.png", b"\x89PNG", "image/png")}, "input_reference"),
        ({"model": "sora-2"}, "model"),
        ({"size": "wide"}, "size"),
        ({"seconds": "forever"}, "seconds"),
        ({"seconds": "100000"}, "seconds"),
    ],
)
def test_refusals_name_the_field(client, options, field):
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.videos.create(prompt="p", **{"seconds": "1", **options})
    error = refused.value.body
    assert refused.value.status_code == 422 and error["code"] == "invalid_request"
    assert field in error["message"], error


def test_remix_and_the_other_routes_not_implemented_say_so_at_once(client):
    """The SDK's remix, edit, extend and characters calls reach routes that exist in
    the OpenAI API but not here: 501 not_implemented saying so, not a 404 that
    reads as a wrong base URL, and the SDK does not retry them (x-should-retry)."""
    sent = []
    retrying = openai.OpenAI(
        base_url=str(client.base_url),
        api_key=KEY,
        max_retries=2,  # the SDK's default: a plain 5xx would be tried three times
        http_client=openai.DefaultHttpxClient(event_hooks={"request": [sent.append]}),
    )
    video = client.videos.create(prompt="a kite", seconds="1")
    with pytest.raises(openai.APIStatusError) as refused:
        retrying.videos.remix(video.id, prompt="a red kite")
    assert refused.value.status_code == 501 and len(sent) == 1
    error = refused.value.body
    assert error["code"] == "not_implemented", error
    assert error["message"].startswith(
        "POST /v1/videos/{video_id}/remix (the OpenAI SDK's videos.remix) exists in the OpenAI API "
        "but is not implemented by this server"
    ), error
    for call in (
        lambda: client.videos.edit(prompt="p", video=("v.mp4", b"0", "video/mp4")),
        lambda: client.videos.extend(prompt="p", seconds="4", video=("v.mp4", b"0", "video/mp4")),
        lambda: client.videos.get_character("char_1"),
    ):
        with pytest.raises(openai.APIStatusError) as refused:
            call()
        assert refused.value.status_code == 501 and refused.value.body["code"] == "not_implemented"
    client.videos.delete(video.id)


def test_a_wrong_key_is_refused(client):
    stranger = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.videos.list()
