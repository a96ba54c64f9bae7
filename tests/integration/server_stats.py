"""What a running server reports about itself: metrics and Triton's statistics."""

from __future__ import annotations

import urllib.request

import tritonclient.grpc as grpcclient


def metric(server, name: str, **labels: str) -> float:
    """Sum of metric `name` over the series whose labels include `labels`."""
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def executions(server, model: str) -> int:
    """How many times Triton executed `model` (its statistics API)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        stats = client.get_inference_statistics(model, as_json=True)
    finally:
        client.close()
    return int(stats["model_stats"][0].get("execution_count", 0))


def wait_for(condition, timeout: float = 30.0, interval: float = 0.2) -> bool:
    """Poll until `condition()` is true or `timeout` passes (a bound for a check, not a speed claim)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
