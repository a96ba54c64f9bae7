"""ChatFlow, the chat model's route-and-stages, served in one process (tests/pipeline.py)."""

import asyncio
import json
import time

import numpy as np
import orjson
import pytest

from pdchat.core.errors import Unavailable
from pdchat.core.request.protocol import parse_chat_json
from pdchat.ensemble.flow import ChatInputs, DecodeCall
from pdchat.ensemble.gate import ForwardedIdsRejected
from pdchat.ensemble.routing import Route
from tests.pipeline import LocalPipeline, LocalStages

KEY = {"PDCHAT_HANDOFF_KEY": "a test key of more than sixteen bytes"}


@pytest.fixture(scope="module")
def prefill_server(tiny_model_dir):
    return LocalPipeline(tiny_model_dir, environ=KEY)


@pytest.fixture(scope="module")
def decode_server(tiny_model_dir):
    return LocalPipeline(tiny_model_dir, parameters={"forwarded_ids": "signed"}, environ=KEY)


def chat(**fields):
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12, "temperature": 0, **fields}
    return parse_chat_json(json.dumps(body))


def remote_prefill(prefill_server, **fields):
    leg = prefill_server.serve(ChatInputs(chat(kv_transfer_params={"do_remote_decode": True}, **fields)))
    assert leg.route is Route.REMOTE_PREFILL
    [answer] = leg.outputs
    return answer, leg.kv_transfer_params


def test_forwarded_ids_skip_the_renderer_and_answer_as_rendering_does(prefill_server, decode_server, monkeypatch):
    answer, kv_transfer_params = remote_prefill(prefill_server)
    assert answer.finish_reason and len(answer.output_token_ids) == 1
    rendered = decode_server.run(chat())[-1]
    renders = []
    monkeypatch.setattr(LocalStages, "render", lambda *args: renders.append(args))
    ids = np.asarray(answer.prompt_token_ids, dtype=np.int32)
    reused = decode_server.serve(ChatInputs(chat(), ids, kv_transfer_params))
    assert reused.route is Route.REUSE and renders == []
    assert reused.outputs[-1].output_token_ids == rendered.output_token_ids
    assert reused.outputs[-1].output_token_ids[0] == answer.output_token_ids[0]  # prefill's first token, kept
    assert decode_server.observer.accepted_count == 1


def test_signed_kv_without_the_ids_renders_and_uses_the_kv(prefill_server, decode_server):
    answer, kv_transfer_params = remote_prefill(prefill_server, max_tokens=5)
    verified = decode_server.serve(ChatInputs(chat(max_tokens=5), None, kv_transfer_params))
    assert verified.route is Route.RENDER_VERIFIED
    assert verified.outputs[-1].output_token_ids == decode_server.run(chat(max_tokens=5))[-1].output_token_ids


def test_a_refused_handoff_is_counted_and_raised_before_any_stage(prefill_server, decode_server):
    answer, kv_transfer_params = remote_prefill(prefill_server)
    ids = np.asarray(answer.prompt_token_ids, dtype=np.int32)
    stages = LocalStages(decode_server, handoff=True)
    other = chat(messages=[{"role": "user", "content": "Another prompt"}])
    with pytest.raises(ForwardedIdsRejected, match="fingerprint_mismatch"):
        asyncio.run(decode_server.flow.serve(ChatInputs(other, ids, kv_transfer_params), stages))
    assert decode_server.observer.rejections[-1] == "fingerprint_mismatch"
    assert stages.route is None and stages.outputs == []


def test_unsigned_ids_are_refused_where_the_gate_is_off(prefill_server):
    params = orjson.dumps({"prompt_token_ids": [1, 2, 3]}).decode()
    with pytest.raises(ForwardedIdsRejected, match="policy_off"):
        prefill_server.serve(ChatInputs(chat(), None, params))


class LeavingClient(LocalStages):
    """A client that leaves after its first response."""

    def __init__(self, pipeline):
        super().__init__(pipeline, handoff=True)
        self.cancelled: list[str] = []
        self.drained = 0

    def client_left(self):
        return bool(self.outputs)

    async def cancel(self, request_id, seal):
        self.seal.check_cancel(request_id, seal)
        self.cancelled.append(request_id)

    async def decode(self, call: DecodeCall):
        async for output in super().decode(call):
            self.drained += 1
            yield output


def test_a_client_that_leaves_cancels_decode_and_its_stream_is_drained(decode_server, monkeypatch):
    monkeypatch.setattr("pdchat.ensemble.flow.CANCEL_POLL_S", 0.0)
    stages = LeavingClient(decode_server)
    asyncio.run(decode_server.flow.serve(ChatInputs(chat(stream=True)), stages))
    assert len(stages.outputs) == 1 and len(stages.cancelled) == 1
    assert stages.drained == 12 and stages.closed  # decode's stream read to its end, then the client's closed


class StallingDecode(LocalStages):
    """A decode that sends its first response, then nothing."""

    def __init__(self, pipeline):
        super().__init__(pipeline, handoff=True)
        self.cancelled: list[str] = []

    async def decode(self, call: DecodeCall):
        async for output in super().decode(call):
            yield output
            await asyncio.sleep(3600)

    async def cancel(self, request_id, seal):
        self.seal.check_cancel(request_id, seal)
        self.cancelled.append(request_id)


def test_a_stalled_decode_is_cancelled_and_the_request_ends_unavailable(decode_server, monkeypatch):
    monkeypatch.setattr(decode_server.flow, "stall_timeout_s", 0.3)
    stages = StallingDecode(decode_server)
    started = time.monotonic()
    with pytest.raises(Unavailable, match=r"decode sent nothing for 0.3 s \(setting stage_stall_timeout_s\)"):
        asyncio.run(decode_server.flow.serve(ChatInputs(chat(stream=True)), stages))
    assert time.monotonic() - started < 5
    assert len(stages.outputs) == 1 and len(stages.cancelled) == 1 and not stages.closed
