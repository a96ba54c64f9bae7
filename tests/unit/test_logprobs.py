"""Logprobs as OpenAI shows them, and the entry that travels from prefill to decode."""

import pytest

from pdchat.core.output.logprobs import TokenLogprobs, TokenSpeller

ENTRY = TokenLogprobs(5, -0.5, ((5, -0.5), (9, -1.0), (2, -3.0)))


def test_an_entry_round_trips_and_malformed_ones_are_refused():
    assert TokenLogprobs.from_json(ENTRY.to_json()) == ENTRY
    for bad in (
        "[]",
        '{"token_id": -1, "logprob": -1, "top": []}',
        '{"token_id": 1, "logprob": "x", "top": []}',
        '{"token_id": 1, "logprob": -1, "top": [[1, 2, 3]]}',
        '{"token_id": true, "logprob": -1, "top": []}',
        "{",
    ):
        with pytest.raises(ValueError, match="malformed token logprobs"):
            TokenLogprobs.from_json(bad)


def test_bytes_of_byte_level_tokens_are_exact_even_for_part_of_a_character(tiny_tokenizer):
    speller = TokenSpeller(tiny_tokenizer)
    for text in (" café", "東京", "☀️🌸"):
        ids = tiny_tokenizer.encode(text, add_special_tokens=False)
        assert bytes(b for i in ids for b in speller.spell(i)[1]) == text.encode()
    partial = next(i for i in tiny_tokenizer.encode("🌸", add_special_tokens=False) if "\ufffd" in speller.spell(i)[0])
    assert speller.spell(partial)[1]  # its bytes, though its text is U+FFFD
    assert speller.spell(2) == ("<|im_end|>", list(b"<|im_end|>"))  # special tokens are spelled, not skipped


def test_content_is_openai_shaped(tiny_tokenizer):
    speller = TokenSpeller(tiny_tokenizer)
    ids = tiny_tokenizer.encode(" hello", add_special_tokens=False)
    [entry] = speller.content([TokenLogprobs(ids[0], -0.1, ((ids[0], -0.1),))])
    assert entry == {
        "token": " hello",
        "logprob": -0.1,
        "bytes": list(b" hello"),
        "top_logprobs": [{"token": " hello", "logprob": -0.1, "bytes": list(b" hello")}],
    }


def test_an_entry_covers_a_request_for_its_token_and_at_most_its_alternatives():
    assert ENTRY.covers(5, 3) and ENTRY.covers(5, 0) and not ENTRY.covers(5, 4) and not ENTRY.covers(6, 1)
    assert ENTRY.trimmed(1) == TokenLogprobs(5, -0.5, ((5, -0.5),)) and ENTRY.trimmed(3) is ENTRY
