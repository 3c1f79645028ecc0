"""A model that knows only a list of prompts (the demo model's 60 captions) draws any
other prompt as the one it shares the most words with: a pure, deterministic rule."""

from __future__ import annotations

from rtvideo.training.demo.scenes import CAPTIONS
from rtvideo.workers.pipelines.conditioning import nearest_known


def test_a_known_prompt_is_itself():
    assert all(nearest_known(caption, CAPTIONS) == caption for caption in CAPTIONS)


def test_an_unknown_prompt_is_the_known_one_sharing_the_most_words():
    assert nearest_known("a blue boat moving up", CAPTIONS) == "a blue circle moving up"
    assert nearest_known("A Yellow TRIANGLE, going left!", CAPTIONS) == "a yellow triangle moving left"
    assert nearest_known("a paper boat drifting down a rainy street", CAPTIONS) == "a red circle moving down"


def test_ties_go_to_the_earliest_so_a_prompt_with_no_known_word_gets_the_first():
    assert CAPTIONS[0] == "a red circle moving right"
    assert nearest_known("a lighthouse in a storm", CAPTIONS) == CAPTIONS[0]
    assert nearest_known("風景", CAPTIONS) == CAPTIONS[0]
    assert nearest_known("a white square", CAPTIONS) == "a white square moving right"
    assert nearest_known("up down", ("x left", "y down", "z up")) == "y down"


def test_a_model_that_knows_no_list_reads_any_prompt():
    assert nearest_known("a lighthouse in a storm", ()) == "a lighthouse in a storm"
