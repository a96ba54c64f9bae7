"""How a chat request moves between the stages, decided by the client-facing `chat` model:
the route (render, reuse forwarded ids, or prefill for a remote decode), the gate that
admits forwarded ids, and the signed handoff from a prefill server to a decode server.
`model_repository/chat_ensemble` chains the same stages as a plain Triton ensemble."""
