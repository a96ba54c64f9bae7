"""Chat templates belong to the server, on a real tritonserver: a request's template is
refused unless the operator allows it, and where allowed a slow one is cut at the render
bound without holding up the other requests."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdchat.clients.chat import ChatError, ChatResult, GrpcChat, chat_inputs, collect
from pdchat.core.errors import ErrorCode
from tests.integration.conftest import ENSEMBLE, ONE_SLOT_RENDER_BOUND_S

FRONT_DOORS = ("chat", ENSEMBLE)
BOUND_S = ONE_SLOT_RENDER_BOUND_S  # one_slot_server's: it allows request templates
# Server-side overhead on top of the bound: a BLS hop or two and a loaded CI machine.
SLACK_S = 1.0
SLOW_TEMPLATE = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
NORMAL = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4, "temperature": 0}


def ask(url: str, model: str, body: dict) -> ChatResult:
    client = GrpcChat(url, model)
    try:
        return collect(client.stream(chat_inputs(body)))
    finally:
        client.close()


def timed_ask(url: str, model: str, body: dict) -> tuple[float, ChatResult | ChatError]:
    """(seconds taken, the answer or the error): the outcome of one request on its own thread."""
    started = time.monotonic()
    try:
        outcome: ChatResult | ChatError = ask(url, model, body)
    except ChatError as exc:
        outcome = exc
    return time.monotonic() - started, outcome


@pytest.mark.parametrize("model", FRONT_DOORS)
def test_a_request_template_is_refused_by_default(server, model):
    body = {**NORMAL, "chat_template_kwargs": {"chat_template": "SYSTEM OVERRIDE {{ messages[0].content }}"}}
    with pytest.raises(ChatError) as info:
        ask(server.grpc_url, model, body)
    assert info.value.code is ErrorCode.INVALID_ARG
    assert "may not set 'chat_template'" in str(info.value)


@pytest.mark.parametrize("model", FRONT_DOORS)
def test_a_slow_template_fails_at_the_bound_while_a_normal_request_completes(one_slot_server, model):
    url = one_slot_server.grpc_url
    assert ask(url, model, NORMAL).output_token_ids  # warm: the first request pays one-off costs
    slow_body = {**NORMAL, "chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}}
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(timed_ask, url, model, slow_body)
        time.sleep(0.2)  # the slow render is under way when the normal request arrives
        normal = pool.submit(timed_ask, url, model, NORMAL)
        (slow_s, slow_outcome), (normal_s, normal_outcome) = slow.result(), normal.result()
    print(f"{model}: slow request failed after {slow_s:.2f} s, normal one answered in {normal_s:.2f} s")
    assert isinstance(slow_outcome, ChatError) and slow_outcome.code is ErrorCode.INVALID_ARG
    assert f"took longer than {BOUND_S:g} s to render" in str(slow_outcome)
    assert slow_s < BOUND_S + SLACK_S
    assert isinstance(normal_outcome, ChatResult) and len(normal_outcome.output_token_ids) == NORMAL["max_tokens"]
    # It may wait out the slow render (chat makes its renderer calls on one lane), no longer.
    assert normal_s < 2 * BOUND_S + SLACK_S
