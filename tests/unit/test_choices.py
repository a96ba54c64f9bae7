"""n > 1 at the OpenAI fronts (pdchat.clients.choices): bodies, order of starts, merging."""

from __future__ import annotations

import json

import pytest

from pdchat.clients.chat import ChatError, ChatOutput
from pdchat.clients.choices import MAX_CHOICES, choice_bodies, choice_count, fan_out
from pdchat.core.errors import ErrorCode
from tests.integration.helpers import blocking


def test_n_is_counted_and_bounded_by_name():
    assert choice_count({}) == 1 and choice_count({"n": 3}) == 3
    for n in (0, MAX_CHOICES + 1, True, 2.0, "2"):
        with pytest.raises(ChatError, match="'n' must be an integer"):
            choice_count({"n": n})


def test_n_above_1_is_refused_beside_a_handoff_which_serves_one_request():
    """A signed handoff is admitted once: choice 1 on would be refused `replayed` after choice 0
    ran (streamed: with its chunks already sent), found on pdchat openai before a decode server."""
    for field, value in (("kv_transfer_params", {"do_remote_decode": True}), ("prompt_token_ids", [1, 2])):
        with pytest.raises(ChatError, match=f"'n' > 1 with {field}: a P/D handoff serves one request"):
            choice_count({"n": 2, field: value})
        assert choice_count({"n": 1, field: value}) == 1
    assert choice_count({"n": 2, "kv_transfer_params": None}) == 2


def test_choice_i_is_seeded_seed_plus_i_and_n_is_left_out():
    assert choice_bodies({"n": 3, "seed": 7, "prompt": "x"}, 3) == [{"seed": 7 + i, "prompt": "x"} for i in range(3)]
    assert choice_bodies({"n": 2, "prompt": "x"}, 2) == [{"prompt": "x"}] * 2
    assert choice_bodies({"n": 2, "seed": "x"}, 2) == [{"seed": "x"}] * 2  # the parser refuses it by name
    assert choice_bodies({"n": 2, "seed": -1}, 2) == [{"seed": -1}, {"seed": 0}]  # choice 0 is refused by name


def test_choice_seeds_are_sent_modulo_2_63_as_the_servers_take_them():
    """The servers parse integers past 2**64 - 1 as floats and refuse them: choice 2 of seed
    2**64 - 2 failed after choices 0 and 1 ran (streamed: a 200 with their chunks, then the error)."""
    seeds = [choice["seed"] for choice in choice_bodies({"n": 3, "seed": 2**64 - 2}, 3)]
    assert seeds == [(2**64 - 2 + i) % 2**63 for i in range(3)] and all(seed < 2**63 for seed in seeds)
    assert [c["seed"] for c in choice_bodies({"n": 2, "seed": 2**63 - 1}, 2)] == [2**63 - 1, 0]


class FakeFront:
    """Each request streams `len` chunks of one token then a usage chunk; records the order
    in which requests start and chunks are read."""

    def __init__(self):
        self.log: list[str] = []

    async def serve(self, body, request_id, form):
        self.log.append(f"start {request_id}")
        seed = body.get("seed", 0)
        if not body.get("stream"):
            choice = {"index": 0, "text": f"s{seed}", "finish_reason": "length"}
            usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
            yield ChatOutput(f"s{seed}", json.dumps({"id": request_id, "choices": [choice], "usage": usage}))
            return
        for token in range(2):
            self.log.append(f"chunk {request_id}")
            choice = {"index": 0, "text": f"{seed}.{token}", "finish_reason": None}
            yield ChatOutput("", json.dumps({"id": request_id, "choices": [choice]}))
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "cached": seed}
        yield ChatOutput("", json.dumps({"id": request_id, "choices": [], "usage": usage}))


def test_streamed_choices_start_one_after_the_others_first_chunk_and_merge_under_one_id():
    front = FakeFront()
    body = {"n": 3, "seed": 10, "stream": True, "stream_options": {"include_usage": True}}
    chunks = [json.loads(o.response_json) for o in blocking(fan_out(front.serve, body, "r", "completion_request"))]
    assert front.log[:6] == ["start r-0", "chunk r-0", "start r-1", "chunk r-1", "start r-2", "chunk r-2"]
    assert {c["id"] for c in chunks} == {"r-0"}
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks[:-1]] == [
        (0, "10.0"),
        (1, "11.0"),
        (2, "12.0"),
        (0, "10.1"),
        (1, "11.1"),
        (2, "12.1"),
    ]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11, "cached": 10}


def test_a_whole_answer_holds_every_choice_and_the_prompt_once():
    front = FakeFront()
    [answer] = blocking(fan_out(front.serve, {"n": 3, "seed": 1}, "r", "request"))
    body = json.loads(answer.response_json)
    assert front.log[0] == "start r-0"
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "s1"), (1, "s2"), (2, "s3")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


def test_one_choice_is_served_as_it_is():
    front = FakeFront()
    assert (
        len(list(blocking(fan_out(front.serve, {"stream": True}, "r", "request")))) == 3 and front.log[0] == "start r"
    )


def test_a_seed_of_2_64_or_more_is_refused_whatever_n():
    """n = 1 was refused by the servers (they parse no integer that large) while n >= 2 wrapped
    it modulo 2**63 (2**64 behaved as seed 0): one rule now, refused by name."""
    for seed in (2**64, 2**70):
        with pytest.raises(ChatError, match="'seed' must be a non-negative integer below 2\\*\\*64") as info:
            choice_bodies({"n": 2, "seed": seed, "prompt": "x"}, 2)
        assert info.value.code is ErrorCode.INVALID_ARG
    assert choice_bodies({"n": 2, "seed": 2**64 - 1}, 2)[1]["seed"] == (2**64) % 2**63
