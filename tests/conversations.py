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
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ],
}

TOOLS = {"tool_result": [WEATHER_TOOL]}


def chat_body(name: str, **fields) -> dict:
    body = {"messages": CONVERSATIONS[name], **fields}
    if name in TOOLS:
        body["tools"] = TOOLS[name]
    return body
