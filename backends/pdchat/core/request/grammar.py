"""Output grammars (xgrammar) of a request: JSON object, JSON schema, forced tool calls.

A constraint spec is plain JSON inside GenerationParams, so prefill (first token) and
decode (the rest) build the same grammar; decode replays the first token into it. This
module checks specs without torch (the router imports it); core.generation.constraints
compiles them against a tokenizer and masks logits.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from pdchat.core.errors import InvalidRequest
from pdchat.core.settings import GrammarLimits

JSON_OBJECT = "json_object"
JSON_SCHEMA = "json_schema"
TOOL_CALL = "tool_call"


# OpenAI's json_schema object; the schema is always enforced, so `strict` false is kept too.
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def response_format_spec(response_format: Any) -> dict[str, Any] | None:
    """OpenAI response_format -> constraint spec (None for plain text). Keys it does not
    take are refused by name: a schema beside `type`, say, would leave the output unconstrained."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in ("text", JSON_OBJECT, JSON_SCHEMA):
        raise InvalidRequest(f"response_format.type must be text, json_object or json_schema; got {kind!r}")
    known_keys("response_format", response_format, ("type", JSON_SCHEMA) if kind == JSON_SCHEMA else ("type",))
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        return {"type": JSON_OBJECT}
    options = response_format.get(JSON_SCHEMA)
    schema = options.get("schema") if isinstance(options, dict) else None
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format json_schema needs json_schema.schema, a JSON schema object")
    known_keys("response_format.json_schema", options, JSON_SCHEMA_KEYS)
    for key, kind_of in (("name", str), ("description", str), ("strict", bool)):
        if options.get(key) is not None and not isinstance(options[key], kind_of):
            raise InvalidRequest(f"response_format.json_schema.{key} must be a {kind_of.__name__}")
    return {"type": JSON_SCHEMA, "schema": schema}


def known_keys(where: str, value: dict[str, Any], keys: Sequence[str], accepted: str = "") -> None:
    """Refuse the keys of the object at `where` outside `keys` by name, saying what it takes
    (`accepted`, else `keys`): no key of a request is dropped unread."""
    unknown = sorted(set(value) - set(keys), key=str)
    if unknown:
        raise InvalidRequest(
            f"{where} has {', '.join(repr(k) for k in unknown)}, which this server does not take; "
            f"it takes {accepted or ', '.join(keys)}"
        )


def tool_choice_spec(tool_choice: Any, tools: list[dict] | None) -> dict[str, Any] | None:
    """tool_choice 'required' or a named function -> a grammar forcing one such call."""
    if tool_choice in (None, "auto", "none"):
        return None
    if not tools:
        raise InvalidRequest("tool_choice needs 'tools'")
    functions = [t["function"] for t in tools]
    if tool_choice == "required":
        chosen = functions
    elif _is_named_choice(tool_choice):
        name = tool_choice["function"]["name"]
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise InvalidRequest(f"tool_choice names '{name}', which is not among the tools")
    else:
        raise InvalidRequest(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}, "
            "with no other keys"
        )
    return {
        "type": TOOL_CALL,
        "tools": [{"name": f["name"], "parameters": f.get("parameters") or {"type": "object"}} for f in chosen],
    }


def _is_named_choice(tool_choice: Any) -> bool:
    """Whether tool_choice is exactly {'type': 'function', 'function': {'name': str}}."""
    if not isinstance(tool_choice, dict) or set(tool_choice) != {"type", "function"}:
        return False
    function = tool_choice["function"]
    return (
        tool_choice["type"] == "function"
        and isinstance(function, dict)
        and set(function) == {"name"}
        and isinstance(function["name"], str)
    )


def check_limits(spec: dict[str, Any], limits: GrammarLimits) -> None:
    """Refuse a spec past `limits` with InvalidRequest naming the limit and its setting.

    NOTE: plain Python over the JSON, linear in its size: it runs wherever a request is
    parsed (router, chat, renderer), before xgrammar sees the spec."""
    size = len(json.dumps(spec, ensure_ascii=False).encode())
    if size > limits.max_bytes:
        raise InvalidRequest(
            f"the output grammar's schema has {size} bytes; this server takes at most "
            f"{limits.max_bytes} (setting grammar_max_bytes)"
        )
    values, depth = 0, 0
    pending: list[tuple[Any, int]] = [(spec, 1)]
    while pending:
        node, level = pending.pop()
        depth = max(depth, level)
        if isinstance(node, dict):
            enum = node.get("enum")
            values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
            pending.extend((child, level + 1) for child in node.values() if isinstance(child, dict | list))
        else:
            pending.extend((child, level + 1) for child in node if isinstance(child, dict | list))
    if values > limits.max_enum_values:
        raise InvalidRequest(
            f"the output grammar's schema has {values} enum and const values; this server takes "
            f"at most {limits.max_enum_values} (setting grammar_max_enum_values)"
        )
    if depth > limits.max_depth:
        raise InvalidRequest(
            f"the output grammar's schema nests {depth} levels deep; this server takes at most "
            f"{limits.max_depth} (setting grammar_max_depth)"
        )


def load_xgrammar() -> None:
    """Import xgrammar now: it imports torch, which takes seconds, and a model's first request
    with a grammar would otherwise pay for it on the thread that serves every request."""
    import xgrammar  # noqa: F401


def check_spec(spec: dict[str, Any]) -> None:
    """Refuse a spec xgrammar cannot use. Cached: the router, `chat` and the renderer each
    validate the same request, and agents resend the same schemas and tools."""
    _check_spec_json(json.dumps(spec, sort_keys=True))


@lru_cache(maxsize=1024)
def _check_spec_json(spec_json: str) -> None:
    grammar_for(json.loads(spec_json))


def grammar_ebnf(spec: dict[str, Any]) -> str:
    """The spec's grammar as EBNF text (what vLLM's structured outputs take). Cached: the
    prefill and decode legs of one request, and agents resending the same tools, build it once."""
    return _grammar_ebnf_json(json.dumps(spec, sort_keys=True))


@lru_cache(maxsize=1024)
def _grammar_ebnf_json(spec_json: str) -> str:
    return str(grammar_for(json.loads(spec_json)))


def grammar_for(spec: dict[str, Any]):
    """The xgrammar Grammar of a spec; raises InvalidRequest for a schema it cannot use."""
    import xgrammar as xgr

    try:
        if spec["type"] == JSON_OBJECT:
            return _json(xgr, {"type": "object"})
        if spec["type"] == JSON_SCHEMA:
            return _json(xgr, spec["schema"])
        calls = [
            xgr.Grammar.concat(
                _literal(f'<tool_call>\n{{"name": {json.dumps(tool["name"])}, "arguments": '),
                _json(xgr, tool["parameters"]),
                _literal("}\n</tool_call>"),
            )
            for tool in spec["tools"]
        ]
        return calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    except (RuntimeError, ValueError) as exc:
        raise InvalidRequest(f"cannot build a grammar for this {spec['type']}: {_reason(exc)}") from exc


# xgrammar's messages start with its C++ source position: "[00:47:10] /project/cpp/x.cc:4950: ".
_SOURCE_POSITION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _reason(exc: Exception) -> str:
    """What xgrammar says is wrong, without its source position."""
    return _SOURCE_POSITION.sub("", str(exc).strip())


def _json(xgr, schema: dict):
    # Compact JSON: free whitespace lets a weak model ramble in blanks until max_tokens.
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def _literal(text: str):
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")
