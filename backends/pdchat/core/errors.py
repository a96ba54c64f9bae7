"""Errors the adapters translate into Triton error codes."""


class InvalidRequest(ValueError):
    """The client sent something we cannot serve; becomes Triton INVALID_ARG.

    The message must say what is wrong and, where it helps, what is accepted.
    """


class ModelUnavailable(RuntimeError):
    """The configured model cannot be found or loaded; fails the model's load."""
