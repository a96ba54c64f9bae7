"""A varied conversation set, shared by the parity tests."""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATIONS = {
    "single_turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system_prompt": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about compilers."},
    ],
    "unicode_emoji": [{"role": "user", "content": "Übersetze: 東京は晴れ ☀️🌸 — naïve café 👩‍🔬"}],
    "tool_result": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ],
}

TOOLS = {"tool_result": [WEATHER_TOOL]}


def chat_body(name: str, **fields) -> dict:
    body = {"messages": CONVERSATIONS[name], **fields}
    if name in TOOLS:
        body["tools"] = TOOLS[name]
    return body


PICK_TOOL = {
    "type": "function",
    "function": {
        "name": "pick_number",
        "description": "Pick a number",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
            "required": ["n", "ok"],
        },
    },
}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
}
LONG_TEXT = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog, naïve café ☕." for i in range(220))

# name -> request fields beyond the shared ones; the parity suite runs each on both paths.
PARITY_CASES = {
    **{
        name: {"messages": messages, **({"tools": TOOLS[name]} if name in TOOLS else {})}
        for name, messages in CONVERSATIONS.items()
    },
    "tools_auto": {"messages": [{"role": "user", "content": "Pick a number."}], "tools": [PICK_TOOL, WEATHER_TOOL]},
    "tool_required": {
        "messages": [{"role": "user", "content": "Pick a number."}],
        "tools": [PICK_TOOL, WEATHER_TOOL],
        "tool_choice": "required",
        "max_tokens": 96,
    },
    "tool_named": {
        "messages": [{"role": "user", "content": "Pick."}],
        "tools": [PICK_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "pick_number"}},
        "max_tokens": 96,
    },
    "reasoning_off": {
        "messages": [{"role": "user", "content": "Think about cats."}],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "reasoning_open": {
        "messages": [{"role": "user", "content": "Plan a trip."}, {"role": "assistant", "content": "<think>\nFirst,"}],
        "continue_final_message": True,
    },
    "stop_strings": {"messages": [{"role": "user", "content": "Say something."}], "stop": ["e ", "a "]},
    "json_schema": {
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
        "max_tokens": 48,
    },
    "json_object": {
        "messages": [{"role": "user", "content": "JSON please."}],
        "response_format": {"type": "json_object"},
    },
    "sampled": {
        "messages": [{"role": "user", "content": "Write a haiku."}],
        "temperature": 0.9,
        "top_p": 0.9,
        "seed": 1234,
    },
    "long_prompt": {"messages": [{"role": "system", "content": "Summarize."}, {"role": "user", "content": LONG_TEXT}]},
}

# Requests setting the sampling controls and logprobs; parity tests compare their tokens and
# logprobs path by path. A few requests each: these fields change no routing, only the choice.
SAMPLING_CASES = {
    "greedy_logprobs": {
        "messages": CONVERSATIONS["multi_turn"],
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        "max_tokens": 8,
    },
    "shaped_sampled": {
        "messages": CONVERSATIONS["unicode_emoji"],
        "temperature": 0.8,
        "seed": 7,
        "top_p": 0.95,
        "top_k": 50,
        "min_p": 0.02,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "repetition_penalty": 1.2,
        "logit_bias": {"30": -100, "260": 5},
        "min_tokens": 4,
        "stop_token_ids": [3297],
        "logprobs": True,
        "top_logprobs": 3,
        "max_tokens": 10,
    },
}
