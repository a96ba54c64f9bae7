"""Output grammars are bounded: limits before anything is built, compiles in a worker process
that a deadline kills, a cache bounded in bytes (pdchat.core.generation.constraints)."""

import json
import time

import pytest
from transformers import AutoTokenizer

from pdchat.core.errors import InvalidRequest
from pdchat.core.generation.constraints import ConstraintCompiler
from pdchat.core.generation.grammar_worker import GrammarCompileTimeout
from pdchat.core.request.grammar import check_limits
from pdchat.core.request.protocol import parse_chat_json
from pdchat.core.settings import CompileOptions, GrammarLimits

LIMITS = GrammarLimits(max_bytes=4096, max_enum_values=10, max_depth=6)


def enum_spec(values: int, prefix: str = "v") -> dict:
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [f"{prefix}{i}x" for i in range(values)]}},
        "required": ["a"],
    }
    return {"type": "json_schema", "schema": schema}


def nested_spec(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"inner": schema}}
    return {"type": "json_schema", "schema": schema}


def test_limits_name_what_is_too_large_and_its_setting():
    check_limits(enum_spec(10), LIMITS)
    with pytest.raises(
        InvalidRequest, match=r"11 enum and const values.*at most 10 \(setting grammar_max_enum_values\)"
    ):
        check_limits(enum_spec(11), LIMITS)
    with pytest.raises(InvalidRequest, match=r"bytes; this server takes at most 4096 \(setting grammar_max_bytes\)"):
        check_limits({"type": "json_schema", "schema": {"description": "x" * 5000}}, LIMITS)
    check_limits(nested_spec(1), LIMITS)
    with pytest.raises(InvalidRequest, match=r"nests \d+ levels deep.*\(setting grammar_max_depth\)"):
        check_limits(nested_spec(4), LIMITS)


def test_a_hundred_thousand_enum_values_are_refused_at_parse_at_once():
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": enum_spec(100_000)["schema"]},
        },
    }
    started = time.perf_counter()
    with pytest.raises(InvalidRequest, match="grammar_max"):
        parse_chat_json(json.dumps(body))
    assert time.perf_counter() - started < 2.0


@pytest.fixture
def compiler(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    made = []

    def make(**options):
        settings = {"timeout_s": 30.0, "cache_bytes": 64 << 20, "worker_rss_bytes": 4 << 30, **options}
        made.append(ConstraintCompiler(tokenizer, len(tokenizer), CompileOptions(**settings)))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_a_compile_past_its_deadline_is_abandoned_and_the_worker_serves_the_next(compiler):
    grammars = compiler(timeout_s=1.0)
    grammars.constraint(enum_spec(3))  # the worker is up
    started = time.perf_counter()
    with pytest.raises(GrammarCompileTimeout, match=r"longer than 1 s.*grammar_compile_timeout_s"):
        grammars.constraint(enum_spec(60_000))
    assert time.perf_counter() - started < 3.0
    assert grammars._worker.restarts == 1
    assert grammars.constraint(enum_spec(4)) is not None


def test_a_worker_grown_past_its_bound_is_replaced_after_its_compile(compiler):
    grammars = compiler(worker_rss_bytes=1)
    assert grammars.constraint(enum_spec(5)) is not None
    assert grammars.constraint(enum_spec(6)) is not None
    assert grammars._worker.restarts == 2


def test_the_cache_is_keyed_by_canonical_spec_and_bounded_in_bytes(compiler):
    grammars = compiler(cache_bytes=1)
    grammars.constraint(enum_spec(5))
    reordered = {"schema": enum_spec(5)["schema"], "type": "json_schema"}
    assert grammars.prepare(reordered).done()  # the same spec, keys in another order: cached
    grammars.constraint(enum_spec(5, prefix="w"))
    assert len(grammars._cache) == 1  # past the byte bound, the least recently used went


def test_a_schema_xgrammar_cannot_build_is_an_invalid_request_from_the_worker(compiler):
    future = compiler().prepare(
        {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}
    )
    with pytest.raises(InvalidRequest, match="cannot build a grammar") as info:
        future.result(60)
    assert "nope" in str(info.value) and ".cc:" not in str(info.value)  # xgrammar's reason, not its source position
