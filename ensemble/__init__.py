"""The chat pipeline as a chain of stages (renderer -> prefill -> decode).

`model_repository/chat_ensemble` chains the stages across Triton models; this package
chains the same core stages in one process, as a reference and for tests.
"""
