"""What clients send: the typed ChatRequest and GenerationParams (protocol), the checks of
output grammars (grammar) — both without torch, for the router — and the chat template
render with its tokenizer (rendering), which the renderer model runs."""
