"""Raw HTTP/1.1 over sockets, for testing the HTTP front with what no HTTP client would send."""

from __future__ import annotations

import http.client
import io
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from pdchat.clients.openai_api import HttpSettings, make_server
from pdchat.launcher import free_port


@contextmanager
def running_fronts(router: Any) -> Iterator[Callable[[HttpSettings], int]]:
    """start(settings) -> the port of an HTTP front on `router`, in this process on a thread
    of its own; every front started is stopped on exit."""
    with ExitStack() as stop:

        def start(settings: HttpSettings) -> int:
            port = free_port()
            server = make_server(router, "127.0.0.1", port, settings)
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            stop.callback(thread.join, 10)
            stop.callback(setattr, server, "should_exit", True)
            deadline = time.monotonic() + 10
            while not server.started and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.started
            return port

        yield start


def request(method: str, path: str, body: bytes = b"", headers: tuple[bytes, ...] = (), length: bool = True) -> bytes:
    """A raw HTTP/1.1 request that asks the server to close after answering."""
    head = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close", *headers]
    if body and length:
        head.append(f"Content-Length: {len(body)}".encode())
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send `data`, then read until the server closes (a server that does not fails the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_to_end(sock)


def read_to_end(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


class _Replies(io.BytesIO):
    """What a server sent, for http.client to parse reply after reply (it closes its file)."""

    def close(self) -> None:
        pass

    def makefile(self, *args) -> _Replies:
        return self


def replies(data: bytes) -> list[tuple[int, http.client.HTTPMessage, bytes]]:
    stream, parsed = _Replies(data), []
    while stream.tell() < len(data):
        reply = http.client.HTTPResponse(stream)  # type: ignore[arg-type]
        reply.begin()
        parsed.append((reply.status, reply.headers, reply.read()))
    return parsed


def one_reply(data: bytes) -> tuple[int, http.client.HTTPMessage, bytes]:
    [reply] = replies(data)
    return reply


def error_of(body: bytes) -> dict:
    """The OpenAI-shaped error of an answer's body."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "code"}
    return error
