"""Errors the adapters translate into Triton error codes, and how their class travels.

gRPC streams (how clients and the router reach the decoupled `chat`) carry a response's
error as a bare message, without its status code. So every error message pdchat sends
starts with its class, `[INVALID_ARG] ...`, and clients read it back with
`split_error_class`: a request the server refused stays a client error at every hop.
"""

from __future__ import annotations

import re

INVALID_ARG = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"
_TAG = re.compile(rf"^\[({INVALID_ARG}|{UNAVAILABLE}|{INTERNAL})\] ")
# Triton puts its own words before a step's error inside an ensemble.
_ENSEMBLE_TAG = re.compile(rf"^in ensemble '[^']*', \[({INVALID_ARG}|{UNAVAILABLE}|{INTERNAL})\] ")


class InvalidRequest(ValueError):
    """The client sent something we cannot serve; becomes Triton INVALID_ARG.

    The message must say what is wrong and, where it helps, what is accepted.
    """


class Unavailable(RuntimeError):
    """A limit of this server is reached (KV budget, queue): retry later or elsewhere.
    Becomes Triton UNAVAILABLE; the message names the limit."""


class ModelUnavailable(RuntimeError):
    """The configured model cannot be found or loaded; fails the model's load."""


def error_class(exc: Exception) -> str:
    if isinstance(exc, InvalidRequest):
        return INVALID_ARG
    if isinstance(exc, Unavailable):
        return UNAVAILABLE
    return INTERNAL


def tagged_message(exc: Exception) -> str:
    """The message to send for `exc`, its class in front (internal ones also name their type)."""
    kind = error_class(exc)
    message = str(exc) if kind != INTERNAL else f"{type(exc).__name__}: {exc}"
    return message if _TAG.match(message) else f"[{kind}] {message}"


def split_error_class(message: str) -> tuple[str, str]:
    """(class or "", message without its tag) of a message `tagged_message` made, also
    when Triton relays it from an ensemble step."""
    match = _TAG.match(message) or _ENSEMBLE_TAG.match(message)
    return (match[1], message[match.end():]) if match else ("", message)
