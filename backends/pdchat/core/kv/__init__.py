"""KV caches between servers: the typed handle prefill hands out, the connector
interface and registry, and its two transports (shm on one host, NIXL across hosts)."""
