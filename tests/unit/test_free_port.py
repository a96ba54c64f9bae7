"""free_port: ports a server binds later come from below the kernel's ephemeral range, which
processes binding port 0 meanwhile (vLLM's engines, UCX) draw from."""

from __future__ import annotations

import socket

from pdchat.launcher import LOWEST_PORT, free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_free(tmp_path):
    port_range = tmp_path / "ip_local_port_range"
    port_range.write_text("32768\t60999\n")
    ports = {free_port(port_range) for _ in range(50)}
    assert all(LOWEST_PORT <= port < 32768 for port in ports) and len(ports) > 40
    for port in list(ports)[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free indeed
