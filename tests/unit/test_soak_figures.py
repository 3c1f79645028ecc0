"""``rtvideo bench soak``'s judgement, on figures given by hand: a server that
fills up once and then stays is no leak, one that grows to the end is; a
figure the server does not export is reported so and judged on nothing; a
chunk counts once its bytes came after its metadata."""

from __future__ import annotations

import pytest

from rtvideo.bench.soak import Chunks, SoakOptions, growth, leaks, slope

URL = "ws://127.0.0.1:8000/v1/realtime/video"


def samples(api_rss: list[float], fds: list[float] | None = None) -> list[dict[str, float | None]]:
    fds = fds or [30.0] * len(api_rss)
    return [
        {"api_rss_mib": rss, "worker_rss_mib": None, "api_open_fds": fd, "worker_open_fds": None}
        for rss, fd in zip(api_rss, fds, strict=True)
    ]


def figures(rounds: list[dict], warm_up: int = 2) -> dict[str, dict]:
    return {name: growth(rounds, name, warm_up) for name in rounds[0]}


def test_slope_is_the_least_squares_fit():
    assert slope([11.0, 11.0, 13.0, 15.0]) == pytest.approx(1.4)
    assert slope([5.0, 5.0, 5.0]) == 0.0
    assert slope([3.0]) is None


def test_growth_counts_from_the_warm_up_and_judges_the_second_half():
    rss = [90.0, 95.0, 100.0, 104.0, 106.0, 107.0, 107.0, 107.0, 107.0, 107.5]
    figure = growth(samples(rss), "api_rss_mib", warm_up=2)
    assert figure["after_warm_up"] == 95.0  # the last warm-up round's sample
    assert figure["growth"] == 12.5 and figure["end"] == 107.5 and figure["max"] == 107.5
    # After the warm-up: 95 .. 107.5 (9 samples); the second half from the 5th of them on.
    assert figure["middle"] == 107.0 and figure["late_growth"] == 0.5
    assert figure["late_slope_per_round"] == pytest.approx(slope([107.0, 107.0, 107.0, 107.0, 107.5]))
    assert figure["per_round"] == rss
    assert growth(samples(rss), "worker_rss_mib", warm_up=2) == {"exported": False}
    assert growth(samples(rss), "api_rss_mib", warm_up=0)["after_warm_up"] == 90.0


def test_a_server_that_fills_up_once_is_no_leak_one_that_grows_to_the_end_is():
    options = SoakOptions(url=URL, max_growth_mib=8.0, max_fd_growth=4)
    filled = [90.0, 100.0, 110.0, 118.0, 120.0, 120.5, 120.5, 121.0, 121.0, 121.0]
    assert leaks(figures(samples(filled)), options) == []
    growing = [90.0 + 3 * i for i in range(10)]  # 3 MiB a round: 12 over the second half
    [found] = leaks(figures(samples(growing)), options)
    assert found.startswith("api_rss_mib grew 12.0 over the second half of the rounds (105.0 to 117.0; limit 8)")
    files = [30.0 + 2 * i for i in range(10)]  # two open files more each round
    [found] = leaks(figures(samples([100.0] * 10, files)), options)
    assert found.startswith("api_open_fds grew 8.0 over the second half of the rounds (40.0 to 48.0; limit 4)")
    assert leaks(figures(samples([100.0] * 10, files)), SoakOptions(url=URL, max_fd_growth=8)) == []


def test_a_chunk_counts_once_its_bytes_came_after_its_metadata():
    chunks = Chunks()
    assert chunks.see("video.start", {"type": "video.start", "request_id": "r"}) is None
    assert chunks.started == {"type": "video.start", "request_id": "r"}
    assert chunks.see("video.chunk_metadata", {"generation_chunk_index": 4, "num_frames": 12}) is None
    assert chunks.indexes == []  # its bytes have not come
    assert chunks.made_from == [(0, 12)]  # no input: made from no input frame
    assert chunks.see("media", {"bytes": 10}) == 4
    assert chunks.see("media", {"bytes": 10}) is None  # bytes without metadata before them: no chunk
    assert chunks.indexes == [4]


@pytest.mark.parametrize(
    ("field", "value", "names"),
    [
        ("minutes", 0, "minutes"),
        ("rounds", 0, "rounds"),
        ("chunks", 1, "chunks"),
        ("concurrency", 0, "concurrency"),
        ("max_growth_mib", float("nan"), "max_growth_mib"),
    ],
)
def test_options_out_of_range_are_refused_by_name(field, value, names):
    with pytest.raises(ValueError, match=names):
        SoakOptions(url=URL, **{field: value})
