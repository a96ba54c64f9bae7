"""What the integration tests share: asking a server, and reading what it reports about
itself (metrics, Triton's statistics)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
import tritonclient.grpc as grpcclient

from pdchat.clients.chat import ChatError, ChatOutput, ChatResult, ChatStream, GrpcChat, HttpChat, chat_inputs, collect
from pdchat.clients.grpc_streams import StreamLoop


def ask(client, body=None, **inputs) -> ChatResult:
    """The whole answer to one request (a JSON body, plus forwarded ids or other inputs)."""
    return collect(client.stream(chat_inputs(body, **inputs)))


def blocking(outputs: ChatStream) -> Iterator[ChatOutput]:
    """A front's `chat` (an async generator) taken from this thread: its steps run on the
    process's stream loop."""
    return StreamLoop.shared().iterate(outputs)


def refusal(client, body=None, **inputs) -> str:
    """The server's message refusing a request."""
    with pytest.raises(ChatError) as info:
        ask(client, body, **inputs)
    return str(info.value)


def summary(result: ChatResult) -> dict:
    """What a client sees, whether it came streamed or whole (tool call ids aside)."""
    content, reasoning, calls = "", "", []
    for output in result.outputs:
        choice = output.response["choices"][0]
        message = choice.get("message") or choice.get("delta") or {}
        content += message.get("content") or ""
        reasoning += message.get("reasoning_content") or ""
        calls += [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []
        ]
    return {
        "ids": result.output_token_ids,
        "text": result.text,
        "content": content,
        "reasoning": reasoning,
        "tool_calls": calls,
        "finish_reason": result.finish_reason,
    }


def responses(result: ChatResult) -> list[dict]:
    """The response JSON of each output (streamed chunks, or the one completion)."""
    return [output.response for output in result.outputs]


def answers_of(client, bodies: dict[str, dict]) -> dict[str, ChatResult]:
    """Each body's answer from one client: the reference a parity test compares paths with."""
    return {name: ask(client, body) for name, body in bodies.items()}


def metric(server, name: str, **labels: str) -> float:
    """Sum of metric `name` over the series whose labels include `labels`."""
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
    )


def conversation(salt: str | None = None, **fields) -> dict:
    """A greedy chat whose system prompt no other test sends (a cold cache for it)."""
    system = f"Session {uuid.uuid4()}. " + "You answer briefly and precisely about lighthouses. " * 20
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Why are they tall?"}],
        "max_tokens": 12,
        "temperature": 0,
        "return_token_ids": True,
        **fields,
    }
    return body if salt is None else {**body, "cache_salt": salt}


def prompt_tokens_computed(server, settle_s: float = 0.1) -> dict[str, float]:
    """Prompt tokens each stage model of `server` computed so far, by model, once two reads
    `settle_s` apart agree (a request that just ended may not have reported its count yet;
    at most 30 reads)."""

    def read() -> dict[str, float]:
        return {m: metric(server, "pdchat_prompt_tokens_computed_total", model=m) for m in ("prefill", "decode")}

    counts = read()
    for _ in range(30 if settle_s else 0):
        time.sleep(settle_s)
        counts, previous = read(), counts
        if counts == previous:
            break
    return counts


def computed_since(server, before: dict[str, float], tokens: int, timeout: float = 5.0) -> dict[str, float]:
    """What each stage model computed since `before` (prompt_tokens_computed), once they
    computed `tokens` together or `timeout` passed: decode reports its pool's counters
    after its answer's last response, not before it."""
    grown: dict[str, float] = {}

    def reached() -> bool:
        now = prompt_tokens_computed(server, settle_s=0)
        grown.update({model: now[model] - before[model] for model in now})
        return sum(grown.values()) >= tokens

    wait_for(reached, timeout, interval=0.05)
    return grown


def chat_renders(server) -> float:
    """Chat prompts the server rendered, by chat itself (short requests) or its renderer: not
    the renderer's executions, which also answer the /tokenize calls vllm-router makes to
    every worker's front."""
    return metric(server, "pdchat_prompts_rendered_total")


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
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def post(stack, body, headers=None):
    """POST a chat completion to a PDStack's router."""
    request = urllib.request.Request(
        f"{stack.router_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    return urllib.request.urlopen(request, timeout=300)


def router_responses(stack, body) -> list[dict]:
    """The router's answer as response JSONs: the SSE chunks, or the one completion."""
    with post(stack, body) as reply:
        if not body.get("stream"):
            return [json.loads(reply.read())]
        return [
            json.loads(line[6:]) for line in reply if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"
        ]


def router_answer(stack, body) -> dict:
    """The answer through the router, assembled the same way streamed or not."""
    answers = router_responses(stack, body)
    if not body.get("stream"):
        message = answers[0]["choices"][0]
        return {
            "content": message["message"]["content"] or "",
            "reasoning": message["message"].get("reasoning_content") or "",
            "tool_calls": [
                (c["function"]["name"], c["function"]["arguments"]) for c in message["message"].get("tool_calls") or []
            ],
            "finish_reason": message["finish_reason"],
            "ids": message.get("token_ids"),
        }
    content, reasoning, calls, finish, ids = "", "", [], None, []
    for answer in answers:
        for choice in answer["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            calls += [(c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls") or []]
            finish = choice["finish_reason"] or finish
            ids += choice.get("token_ids") or []
    return {"content": content, "reasoning": reasoning, "tool_calls": calls, "finish_reason": finish, "ids": ids}


class StreamReader(threading.Thread):
    """A streamed chat completion POSTed to `base_url`, read in the background. `events`:
    each SSE event's JSON, "[DONE]" for the last; `first` is set at the first event;
    `ended_at`: when the stream ended (time.monotonic()); `status`: the HTTP status."""

    def __init__(self, base_url: str, body: dict, headers: dict | None = None):
        super().__init__(daemon=True)
        self.request = urllib.request.Request(
            f"{base_url}/v1/chat/completions",
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        self.events: list = []
        self.first = threading.Event()
        self.status = 0
        self.ended_at = 0.0
        self.start()

    def run(self) -> None:
        try:
            with urllib.request.urlopen(self.request, timeout=300) as reply:
                self.status = reply.status
                for line in reply:
                    if line.startswith(b"data: "):
                        data = line[6:].strip()
                        self.events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
                        self.first.set()
        except urllib.error.HTTPError as exc:
            self.status = exc.code
            self.events.append(json.loads(exc.read()))
        finally:
            self.ended_at = time.monotonic()
            self.first.set()


@contextlib.contextmanager
def pd_clients(stack) -> Iterator[dict]:
    """Chat clients of a P/D pair: the decode server's over gRPC and HTTP, the prefill server's
    over gRPC ("prefill")."""
    made = {
        "grpc": GrpcChat(stack.decode.grpc_url, "chat"),
        "http": HttpChat(stack.decode.http_url, "chat"),
        "prefill": GrpcChat(stack.prefill.grpc_url, "chat"),
    }
    try:
        yield made
    finally:
        for client in made.values():
            client.close()


def prefill_leg(clients: dict, body: dict) -> ChatOutput:
    """The prefill server's leg (pd_clients): first token, prompt ids, signed kv_transfer_params."""
    [output] = list(clients["prefill"].stream(chat_inputs(body, kv_transfer_params={"do_remote_decode": True})))
    assert output.kv_transfer_params["signature"] and len(output.output_token_ids) == 1
    return output


def forwarded(handed: ChatOutput) -> dict:
    """The inputs that forward a prefill leg's ids and handoff to decode."""
    return {"prompt_token_ids": handed.prompt_token_ids, "kv_transfer_params": handed.kv_transfer_params}
