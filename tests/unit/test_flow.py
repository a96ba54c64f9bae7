"""ChatFlow, the chat model's route-and-stages, served in one process (tests/pipeline.py)."""

import asyncio
import json
import time

import numpy as np
import orjson
import pytest

from pdchat.core.errors import InvalidRequest, Unavailable
from pdchat.core.output.responses import FAILED, ClientOutput
from pdchat.core.request.protocol import parse_chat_json
from pdchat.ensemble.decode_load import DecodeLoad, LoadSlot
from pdchat.ensemble.flow import LOCAL_BURST_S, ChatInputs, DecodeCall
from pdchat.ensemble.gate import ForwardedIdsRejected
from pdchat.ensemble.routing import Route
from pdchat.registry import SHM
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
    renders_before = decode_server.observer.rendered_count
    rendered = decode_server.run(chat())[-1]
    assert decode_server.observer.rendered_count == renders_before + 1  # a short request: chat renders it
    renders = []
    monkeypatch.setattr(LocalStages, "render", lambda *args: renders.append(args))
    ids = np.asarray(answer.prompt_token_ids, dtype=np.int32)
    reused = decode_server.serve(ChatInputs(chat(), ids, kv_transfer_params))
    assert reused.route is Route.REUSE and renders == []
    assert decode_server.observer.rendered_count == renders_before + 1
    assert reused.outputs[-1].output_token_ids == rendered.output_token_ids
    assert reused.outputs[-1].output_token_ids[0] == answer.output_token_ids[0]  # prefill's first token, kept
    assert decode_server.observer.accepted_count == 1


def test_chat_renders_short_requests_itself_and_sends_the_others_to_the_renderer(tiny_model_dir, monkeypatch):
    """Over chat_render_max_chars, or with a chat_template of its own, a request goes to the
    renderer stage; either way the answer is the same, token for token."""
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    server = LocalPipeline(
        tiny_model_dir, parameters={"allow_request_templates": "true", "chat_render_max_chars": "40"}
    )
    to_renderer = []
    real_render = LocalStages.render

    async def counted(self, request_json, seal):
        to_renderer.append(request_json)
        return await real_render(self, request_json, seal)

    monkeypatch.setattr(LocalStages, "render", counted)
    short = "x" * 40
    cases = [
        (chat(messages=[{"role": "user", "content": short}]), False),
        (chat(messages=[{"role": "user", "content": short + "y"}]), True),
        (chat(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"chat_template": template}), True),
    ]
    for request, by_renderer in cases:
        renders, sent = server.observer.rendered_count, len(to_renderer)
        here = server.run(request)
        assert (len(to_renderer) - sent, server.observer.rendered_count - renders) == (
            int(by_renderer),
            int(not by_renderer),
        )
        assert here[-1].output_token_ids == renderer_stage_answer(tiny_model_dir, request)


def renderer_stage_answer(model_dir, request) -> list[int]:
    """The answer's tokens where every render goes to the renderer stage (chat_render_max_chars 0)."""
    server = LocalPipeline(model_dir, parameters={"allow_request_templates": "true", "chat_render_max_chars": "0"})
    answer = server.run(request)
    assert server.observer.rendered_count == 0
    return answer[-1].output_token_ids


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
    assert len(stages.outputs) == 1 and len(stages.cancelled) == 1  # prefill's first output
    # decode's stream (from the second output on) read to its end, then the client's closed
    assert stages.drained == 11 and stages.closed


class LeavingDuringAWholeAnswer(LocalStages):
    """A client gone while decode makes a whole answer: decode sends nothing until told to cancel."""

    def __init__(self, pipeline):
        super().__init__(pipeline, handoff=True)
        self.cancelled: list[str] = []
        self.told = asyncio.Event()

    def client_left(self):
        return True

    async def decode(self, call: DecodeCall):
        await self.told.wait()
        return
        yield

    async def cancel(self, request_id, seal):
        self.seal.check_cancel(request_id, seal)
        self.cancelled.append(request_id)
        self.told.set()


def test_a_client_that_leaves_a_silent_decode_is_seen_before_decode_answers(decode_server, monkeypatch):
    monkeypatch.setattr("pdchat.ensemble.flow.IDLE_POLL_S", 0.05)
    stages = LeavingDuringAWholeAnswer(decode_server)
    started = time.monotonic()
    asyncio.run(decode_server.flow.serve(ChatInputs(chat()), stages))
    assert len(stages.cancelled) == 1 and time.monotonic() - started < 5  # not stall_timeout_s (45 s)
    assert not stages.outputs and stages.closed


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
    # prefill's first output, decode's one; then the cancellation
    assert len(stages.outputs) == 2 and len(stages.cancelled) == 1 and not stages.closed


def reuse(decode_server, kv_transfer_params, answer, stages=None, **fields):
    """The decode leg of a handoff; the stages hold what its client got."""
    stages = stages or LocalStages(decode_server, handoff=True)
    ids = np.asarray(answer.prompt_token_ids, dtype=np.int32)
    asyncio.run(decode_server.flow.serve(ChatInputs(chat(**fields), ids, kv_transfer_params), stages))
    return stages


def test_a_handoff_whose_request_chat_refuses_stays_good_for_the_corrected_request(prefill_server, decode_server):
    answer, kv_transfer_params = remote_prefill(prefill_server)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        reuse(decode_server, kv_transfer_params, answer, max_tokens=10**6)
    assert reuse(decode_server, kv_transfer_params, answer).outputs[-1].finish_reason == "length"
    with pytest.raises(ForwardedIdsRejected, match=r"\(replayed\): this handoff was used already"):
        reuse(decode_server, kv_transfer_params, answer)


class RefusingDecode(LocalStages):
    """A decode that refuses the request as decode does: its stream's first and only response an error."""

    async def decode(self, call: DecodeCall):
        yield ClientOutput("", '{"error": {"message": "queue full"}}', finish_reason=FAILED)


class FailingDecode(LocalStages):
    """A decode whose stream fails before its first response."""

    async def decode(self, call: DecodeCall):
        raise Unavailable("decode is gone")
        yield


@pytest.mark.parametrize("signed_kv_only", [False, True], ids=["reuse", "render_verified"])
def test_a_handoff_decode_refuses_stays_good(prefill_server, decode_server, signed_kv_only):
    answer, kv_transfer_params = remote_prefill(prefill_server)
    ids = None if signed_kv_only else np.asarray(answer.prompt_token_ids, dtype=np.int32)

    def serve(stages):
        asyncio.run(decode_server.flow.serve(ChatInputs(chat(), ids, kv_transfer_params), stages))
        return stages

    refused = serve(RefusingDecode(decode_server, handoff=True))
    assert refused.route is (Route.RENDER_VERIFIED if signed_kv_only else Route.REUSE)
    assert [output.finish_reason for output in refused.outputs] == [FAILED]
    with pytest.raises(Unavailable, match="decode is gone"):
        serve(FailingDecode(decode_server, handoff=True))
    assert serve(LocalStages(decode_server, handoff=True)).outputs[-1].finish_reason == "length"
    with pytest.raises(ForwardedIdsRejected, match="replayed"):
        serve(LocalStages(decode_server, handoff=True))


class HeldDecode(LocalStages):
    """A decode that answers only once told to."""

    def __init__(self, pipeline):
        super().__init__(pipeline, handoff=True)
        self.reached, self.proceed = asyncio.Event(), asyncio.Event()

    async def decode(self, call: DecodeCall):
        self.reached.set()
        await self.proceed.wait()
        async for output in super().decode(call):
            yield output


def test_a_handoff_in_flight_is_refused_to_a_second_request(prefill_server, decode_server):
    answer, kv_transfer_params = remote_prefill(prefill_server)
    inputs = ChatInputs(chat(), np.asarray(answer.prompt_token_ids, dtype=np.int32), kv_transfer_params)

    async def twice() -> HeldDecode:
        held = HeldDecode(decode_server)
        first = asyncio.create_task(decode_server.flow.serve(inputs, held))
        await held.reached.wait()
        with pytest.raises(ForwardedIdsRejected, match=r"\(replayed\): this handoff is in use by a request in flight"):
            await decode_server.flow.serve(inputs, LocalStages(decode_server, handoff=True))
        held.proceed.set()
        await first
        return held

    assert asyncio.run(twice()).outputs[-1].finish_reason == "length"
    with pytest.raises(ForwardedIdsRejected, match="this handoff was used already"):
        asyncio.run(decode_server.flow.serve(inputs, LocalStages(decode_server, handoff=True)))


async def _decoded(stages: LocalStages, call: DecodeCall) -> list[ClientOutput]:
    return [output async for output in stages.decode(call)]


@pytest.mark.parametrize("forwarded", [False, True], ids=["render", "reuse"])
def test_a_ticket_is_the_decode_call_chat_would_relay(prefill_server, decode_server, forwarded):
    """A client asking for a ticket gets decode's sealed call, no output; decoding it gives
    the answer chat relays; a forwarded handoff is spent by the ticket."""
    inputs = ChatInputs(chat())
    if forwarded:
        answer, kv_transfer_params = remote_prefill(prefill_server)
        inputs = ChatInputs(chat(), np.asarray(answer.prompt_token_ids, dtype=np.int32), kv_transfer_params)
    ticketed = LocalStages(decode_server, handoff=True)
    ticketed.ticketed = True
    asyncio.run(decode_server.flow.serve(inputs, ticketed))
    assert ticketed.route is (Route.REUSE if forwarded else Route.RENDER)
    [call] = ticketed.tickets
    assert ticketed.outputs == [] and not ticketed.closed and call.heartbeat_s is None
    assert ticketed.feed_seals == [None]  # it asked no feed grant
    outputs = asyncio.run(_decoded(LocalStages(decode_server, handoff=True), call))
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in decode_server.run(chat())]
    if forwarded:
        with pytest.raises(ForwardedIdsRejected, match="this handoff was used already"):
            asyncio.run(decode_server.flow.serve(inputs, LocalStages(decode_server, handoff=True)))


def test_a_ticket_carries_the_grant_of_the_feed_its_client_asked_for(decode_server):
    stages = LocalStages(decode_server, handoff=True)
    stages.ticketed, stages.feed_grant = True, "feed-1"
    asyncio.run(decode_server.flow.serve(ChatInputs(chat()), stages))
    [grant] = stages.feed_seals
    decode_server.flow.seal.check_feed("feed-1", grant)  # opens decode's feed of that name, once


@pytest.fixture
def decode_load(decode_server, tmp_path, monkeypatch):
    """decode_server's flow reading a load published in tmp_path, its decode instance's
    slot at 0 (idle); prefill's calls counted in `prefills`."""
    slot = LoadSlot(tmp_path, "decode_0_0", 10**6)
    slot.now = 0.0  # the flow's clock: tests move it past a burst
    monkeypatch.setattr(decode_server.flow, "decode_load", DecodeLoad(tmp_path))
    monkeypatch.setattr(decode_server.flow, "local_prefill_when_idle", True)
    monkeypatch.setattr(decode_server.flow, "_local", None)
    monkeypatch.setattr(decode_server.flow, "clock", lambda: slot.now)
    slot.prefills = []
    real_prefill = LocalStages.prefill

    async def counted(self, rendered, destination, first_output):
        slot.prefills.append(destination)
        return await real_prefill(self, rendered, destination, first_output)

    monkeypatch.setattr(LocalStages, "prefill", counted)
    yield slot
    slot.close()


@pytest.mark.parametrize("ticketed", [False, True])
def test_an_idle_decode_prefills_a_plain_prompt_itself_and_answers_the_same(decode_server, decode_load, ticketed):
    """While decode publishes no sequence held, chat skips prefill: decode's call carries no
    KV handle, its seal opens decode, and the answer is the one prefill's KV gives. A busy
    decode leaves the prompt to prefill."""
    decode_load.set(1)
    with_prefill = decode_server.run(chat())
    assert decode_load.prefills == [SHM]
    decode_load.now += LOCAL_BURST_S
    decode_load.set(0)
    stages = LocalStages(decode_server, handoff=True)
    stages.ticketed = ticketed
    asyncio.run(decode_server.flow.serve(ChatInputs(chat()), stages))
    outputs = (
        asyncio.run(_decoded(LocalStages(decode_server, handoff=True), stages.tickets[0]))
        if ticketed
        else stages.outputs
    )
    assert decode_load.prefills == [SHM] and stages.route is Route.RENDER
    if ticketed:
        assert stages.tickets[0].kv_handle == ""
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in with_prefill]


def test_in_a_burst_only_the_prompt_decode_took_goes_to_decode_again(decode_server, decode_load):
    """Within LOCAL_BURST_S of a prompt an idle decode took, the same prompt (the next of n
    choices) goes to decode, where its blocks are, and another prompt to prefill; past it,
    decode's load decides again."""
    decode_server.run(chat())  # decode idle: it prefills
    decode_load.set(1)  # holding it
    decode_load.now += LOCAL_BURST_S / 2
    decode_server.run(chat())
    assert decode_load.prefills == [], "the burst's own prompt went to prefill"
    decode_load.now += LOCAL_BURST_S / 2
    decode_server.run(chat(max_tokens=11))  # the same messages, other params: the same ids
    assert decode_load.prefills == [], "the burst follows its last prompt's time"
    decode_load.set(0)
    decode_server.run(chat(messages=[{"role": "user", "content": "Another story"}]))
    assert decode_load.prefills == [SHM], "another prompt in the burst went to decode"
    decode_load.now += LOCAL_BURST_S
    decode_server.run(chat(messages=[{"role": "user", "content": "Another story"}]))
    assert decode_load.prefills == [SHM], "past the burst, an idle decode was not given the prompt"
    decode_load.set(1)
    decode_load.now += LOCAL_BURST_S
    decode_server.run(chat())
    assert decode_load.prefills == [SHM, SHM]


def test_where_decode_may_not_take_the_request_the_first_output_waits_for_decode(
    decode_server, decode_load, monkeypatch
):
    """A request that may wait in decode's queue (requests queued for room), or be refused
    there (larger than its KV pool), gets no output before decode takes it: the first output
    is decode's own, the stream the same."""
    monkeypatch.setattr(decode_server.flow, "local_prefill_when_idle", False)
    outputs = []
    for queued, pool_tokens, early in ((0, 10**6, True), (1, 10**6, False), (0, 8, False)):
        decode_load.pool_tokens = pool_tokens
        decode_load.set(2, queued)
        stages = LocalStages(decode_server, handoff=True)
        asyncio.run(decode_server.flow.serve(ChatInputs(chat(stream=True)), stages))
        outputs.append(_identity_and_rest(stages.outputs)[1])
        assert len(stages.sent) == early, (queued, pool_tokens)
    assert outputs[0] == outputs[1] == outputs[2]


def test_a_prompt_served_beside_others_goes_to_prefill_though_decode_is_idle(decode_server, decode_load, monkeypatch):
    monkeypatch.setattr(decode_server.flow, "_serving", 1)  # another request inside serve()
    decode_server.run(chat())
    assert decode_load.prefills == [SHM]
    monkeypatch.setattr(decode_server.flow, "_serving", 0)
    decode_load.now += LOCAL_BURST_S
    decode_server.run(chat())
    assert decode_load.prefills == [SHM] and decode_server.flow._serving == 0


def _identity_and_rest(outputs):
    bodies = [json.loads(o.response) for o in outputs]
    rest = [
        (o.text_output, o.output_token_ids, o.finish_reason, {k: v for k, v in b.items() if k not in ("id", "created")})
        for o, b in zip(outputs, bodies, strict=True)
    ]
    return {(b["id"], b["created"]) for b in bodies}, rest


def test_a_prefill_legs_first_output_and_the_decode_legs_stream_are_one_answer(prefill_server, decode_server):
    """The router's P/D stream: the prefill leg sends the first output before its answer, the
    decode leg goes on from the second, as the same response (id and created, signed into
    the handoff); together, the answer one server streams."""
    leg = LocalStages(prefill_server, handoff=True)
    leg.first_output_early = True
    asyncio.run(
        prefill_server.flow.serve(ChatInputs(chat(kv_transfer_params={"do_remote_decode": True}, stream=True)), leg)
    )
    first, answer = leg.outputs
    assert leg.sent == [first] and not first.final and answer.finish_reason
    decode_leg = LocalStages(decode_server, handoff=True)
    decode_leg.first_output_sent = True
    reuse(decode_server, leg.kv_transfer_params, answer, stages=decode_leg, stream=True)
    assert decode_leg.route is Route.REUSE
    identities, rest = _identity_and_rest([first, *decode_leg.outputs])
    assert len(identities) == 1
    assert rest == _identity_and_rest(decode_server.run(chat(stream=True), handoff=False))[1]
