"""What clients get: token ids -> text (incremental detokenizer, stop strings), text ->
content, reasoning and tool calls, and the OpenAI-shaped responses built from them."""
