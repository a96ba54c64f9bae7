"""Incremental detokenization and stop strings."""

import pytest

from pdchat.core.output.detokenizer import IncrementalDetokenizer
from pdchat.core.output.stopping import StopStringMatcher

SAMPLES = [
    "Hello, world! Plain ASCII text.",
    "Grüße aus Köln – naïve café, 東京タワー, Ελληνικά",
    "emoji 🤖🚀 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and math ∑∫√",
    "  leading spaces\nnew lines\n\ttabs",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_deltas_concatenate_to_the_whole_decode_without_broken_characters(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detokenizer.push(i) for i in ids] + [detokenizer.flush()]
    assert "".join(deltas) == tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_split_across_tokens_is_held_back(tiny_tokenizer):
    ids = tiny_tokenizer.encode("🤖", add_special_tokens=False)
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detokenizer = IncrementalDetokenizer(tiny_tokenizer)
    assert [detokenizer.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.push(ids[-1]) == "🤖"


def test_special_tokens_produce_no_text(tiny_tokenizer):
    detokenizer = IncrementalDetokenizer(tiny_tokenizer)
    assert detokenizer.push(tiny_tokenizer.eos_token_id) == ""


def test_stop_string_split_over_deltas_truncates_before_it():
    matcher = StopStringMatcher(("STOP",))
    released = []
    for piece in ["abc S", "TO", "P and more"]:
        text, hit = matcher.feed(piece)
        released.append(text)
        if hit:
            break
    assert "".join(released) == "abc " and hit


def test_near_miss_is_released_at_the_end():
    matcher = StopStringMatcher(("STOP",))
    text, hit = matcher.feed("xST")
    assert (text, hit) == ("", False)
    assert matcher.flush() == "xST"


def test_without_stop_strings_everything_passes_at_once():
    matcher = StopStringMatcher(())
    assert matcher.feed("abc") == ("abc", False)


def test_earliest_of_several_stop_strings_wins():
    matcher = StopStringMatcher(("world", "lo"))
    assert matcher.feed("hello world") == ("hel", True)
