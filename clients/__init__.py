"""Everything that talks to the servers from outside: the chat client (tritonclient gRPC
and HTTP), the P/D router and its OpenAI-compatible HTTP front, load and benchmarks."""
