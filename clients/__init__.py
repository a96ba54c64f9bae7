"""What users run to talk to the servers from outside: the chat client (tritonclient gRPC and
HTTP), the P/D router and its OpenAI-compatible HTTP front. The benchmark harnesses live in
benchmarks/ at the checkout root, outside the package."""
