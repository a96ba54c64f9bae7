"""The forwarded-id gate: every way in, and every way to be refused."""

import json
import time

import pytest

from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.kv.base import KVHandle, KVUnavailable
from pdchat.core.output.logprobs import TokenLogprobs
from pdchat.core.request.protocol import parse_chat_json
from pdchat.ensemble.gate import ForwardedIdsRejected, Gate, Policy, Rejection, forwarded_ids
from pdchat.ensemble.handoff import Handoff, load_key, render_fingerprint, sign
from pdchat.ensemble.routing import Route, RoutePlanner

KEY = b"k" * 32
IDS = [1, 5, 9, 200]
NOW = 1_000_000.0


def chat(content="hi", **fields):
    return parse_chat_json(json.dumps({"messages": [{"role": "user", "content": content}], **fields}))


def gate(policy=Policy.SIGNED, key=KEY):
    return Gate(policy, key, vocab_size=1000, context_length=100)


HANDLE = KVHandle("shm", (2, 2, 1, 4, 8), NOW + 60, 7, {"name": "x"})
WITH_LOGPROBS = KVHandle(
    "shm", (2, 2, 1, 4, 8), NOW + 60, 7, {"name": "x"}, TokenLogprobs(7, -0.25, ((7, -0.25), (3, -1.5)))
)


def signed(request=None, ids=IDS, **kw):
    return sign(KEY, ids, render_fingerprint(request or chat(), "m"), now=NOW, **kw).to_params()


def admit(params, request=None, ids=IDS, policy=Policy.SIGNED, now=NOW + 1, on=None):
    return (on or gate(policy)).admit(ids, params, render_fingerprint(request or chat(), "m"), now=now)


def reason(call):
    with pytest.raises(ForwardedIdsRejected) as info:
        call()
    return info.value.reason


def test_signed_ids_for_this_request_are_admitted_with_their_kv_handle():
    assert admit(signed(kv_handle=HANDLE)).kv_handle == HANDLE


def test_the_handoff_crosses_the_wire_as_one_serialization():
    handoff = sign(KEY, IDS, "f" * 64, kv_handle=HANDLE, now=NOW, response_id="chatcmpl-1", created=1_700_000_000)
    assert Handoff.from_params(json.loads(handoff.to_json())) == handoff
    assert admit(signed(response_id="chatcmpl-1", created=5)).handoff.response_id == "chatcmpl-1"
    assert KVHandle.from_json(HANDLE.to_json()) == HANDLE


def test_first_token_logprobs_travel_inside_the_signed_handle():
    assert KVHandle.from_json(WITH_LOGPROBS.to_json()) == WITH_LOGPROBS
    assert "first_token_logprobs" not in HANDLE.to_dict()  # nothing added when not asked for
    assert admit(signed(kv_handle=WITH_LOGPROBS)).kv_handle == WITH_LOGPROBS
    altered = {**WITH_LOGPROBS.to_dict(), "first_token_logprobs": {"token_id": 7, "logprob": -0.01, "top": []}}
    assert reason(lambda: admit({**signed(kv_handle=WITH_LOGPROBS), "kv_handle": altered})) is Rejection.BAD_SIGNATURE
    added = {**HANDLE.to_dict(), "first_token_logprobs": WITH_LOGPROBS.first_token_logprobs.to_dict()}
    assert reason(lambda: admit({**signed(kv_handle=HANDLE), "kv_handle": added})) is Rejection.BAD_SIGNATURE
    for bad in (
        {"token_id": 8, "logprob": -0.1, "top": []},
        {"token_id": 7, "logprob": 0.5, "top": []},
        {"token_id": 7, "logprob": -0.1, "top": [[1]]},
        {"token_id": 7, "logprob": -0.1},
    ):
        with pytest.raises(KVUnavailable, match="malformed KV handle"):
            KVHandle.from_dict({**HANDLE.to_dict(), "first_token_logprobs": bad})


def test_a_handoff_serves_one_request_then_is_refused_as_replayed_until_it_expires():
    once = gate()
    params = signed(kv_handle=HANDLE)
    admission = admit(params, on=once)
    assert admission.kv_handle == HANDLE
    with pytest.raises(ForwardedIdsRejected, match=r"\(replayed\): this handoff is in use by a request in flight"):
        admit(params, on=once, now=NOW + 2)  # a second use while the first is in flight
    admission.spend()  # decode took the request
    admission.release()  # settled already: no effect
    with pytest.raises(ForwardedIdsRejected, match=r"\(replayed\): this handoff was used already"):
        admit(params, on=once, now=NOW + 2)
    assert reason(lambda: admit(params, on=once, now=NOW + 61)) is Rejection.EXPIRED
    assert admit(signed(), on=once).kv_handle is None  # another handoff is unaffected


def test_a_released_handoff_may_be_used_again():
    once = gate()
    params = signed(kv_handle=HANDLE)
    with admit(params, on=once):  # released on exit: its request was refused
        pass
    with pytest.raises(RuntimeError), admit(params, on=once, now=NOW + 2):
        raise RuntimeError("the request failed before decode took it")
    with admit(params, on=once, now=NOW + 3) as admission:
        admission.spend()
    assert reason(lambda: admit(params, on=once, now=NOW + 4)) is Rejection.REPLAYED
    assert len(once._uses) == len(once._by_expiry) == 1  # one entry per handoff, however often it was released


def test_sampling_fields_are_outside_the_fingerprint_render_inputs_inside():
    base = render_fingerprint(chat(), "m")
    assert render_fingerprint(chat(temperature=0.1, max_tokens=3, stream=True, seed=4), "m") == base
    for changed in (
        chat("other"),
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        chat(chat_template_kwargs={"enable_thinking": False}),
    ):
        assert render_fingerprint(changed, "m") != base
    assert render_fingerprint(chat(), "other-model") != base


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (lambda: admit(signed(), policy=Policy.OFF), Rejection.POLICY_OFF),
        (lambda: admit({}), Rejection.UNSIGNED),
        (lambda: admit({**signed(), "signature": "0" * 64}), Rejection.BAD_SIGNATURE),
        (lambda: admit(signed(), ids=[1, 5, 9, 201]), Rejection.BAD_SIGNATURE),
        (
            lambda: admit({**signed(kv_handle=HANDLE), "kv_handle": {**HANDLE.to_dict(), "location": {"name": "y"}}}),
            Rejection.BAD_SIGNATURE,
        ),
        (lambda: admit({**signed(), "kv_handle": {"host": "10.0.0.9"}}), Rejection.MALFORMED),
        (lambda: admit({**signed(), "signature": "é" * 64}), Rejection.BAD_SIGNATURE),
        (lambda: admit({**signed(), "signature": "\ud800" * 64}), Rejection.BAD_SIGNATURE),
        (lambda: admit({**signed(), "signature": 12}), Rejection.MALFORMED),
        (lambda: admit({**signed(), "expires_at": NOW + 10_000}), Rejection.BAD_SIGNATURE),
        (lambda: admit(signed(), now=NOW + 61), Rejection.EXPIRED),
        (lambda: admit(signed(), request=chat("a different conversation")), Rejection.FINGERPRINT_MISMATCH),
        (lambda: admit(signed(ids=[]), ids=[]), Rejection.EMPTY),
        (lambda: admit(signed(ids=[1, 1000]), ids=[1, 1000]), Rejection.OUT_OF_VOCABULARY),
        (lambda: admit(signed(ids=[-1, 3]), ids=[-1, 3]), Rejection.OUT_OF_VOCABULARY),
        (lambda: admit(signed(ids=[1] * 100), ids=[1] * 100), Rejection.TOO_LONG),
        (lambda: admit({"signature": "ab"}), Rejection.MALFORMED),
        (lambda: admit({**signed(response_id="chatcmpl-a"), "response_id": "chatcmpl-b"}), Rejection.BAD_SIGNATURE),
        (lambda: admit({**signed(created=7), "created": 8}), Rejection.BAD_SIGNATURE),
        (lambda: admit({**signed(), "created": "7"}), Rejection.MALFORMED),
    ],
)
def test_every_refusal_names_its_reason(case, expected):
    assert reason(case) is expected


def test_trusted_accepts_unsigned_ids_but_still_checks_them():
    assert admit({}, policy=Policy.TRUSTED).kv_handle is None
    assert reason(lambda: admit({}, ids=[5000], policy=Policy.TRUSTED)) is Rejection.OUT_OF_VOCABULARY


def test_signed_policy_without_a_key_refuses_to_start():
    with pytest.raises(ModelUnavailable, match="PDCHAT_HANDOFF_KEY"):
        gate(key=None)


def test_key_from_env_or_file(tmp_path):
    assert load_key({}) is None
    assert load_key({"PDCHAT_HANDOFF_KEY": "x" * 20}) == b"x" * 20
    (tmp_path / "key").write_text("y" * 40 + "\n")
    assert load_key({"PDCHAT_HANDOFF_KEY_FILE": str(tmp_path / "key")}) == b"y" * 40
    with pytest.raises(ModelUnavailable, match="at least 16 bytes"):
        load_key({"PDCHAT_HANDOFF_KEY": "short"})
    with pytest.raises(ModelUnavailable, match="cannot read"):
        load_key({"PDCHAT_HANDOFF_KEY_FILE": str(tmp_path / "missing")})


def test_ids_come_from_the_tensor_or_the_vllm_list_not_both():
    assert forwarded_ids([1, 2], None) == ([1, 2], {})
    assert forwarded_ids(None, json.dumps({"prompt_token_ids": [3], "signature": "s"})) == ([3], {"signature": "s"})
    for bad in ('{"prompt_token_ids": "1,2"}', "[1]", "{nope"):
        assert reason(lambda bad=bad: forwarded_ids(None, bad)) is Rejection.MALFORMED
    assert reason(lambda: forwarded_ids([1], '{"prompt_token_ids": [1]}')) is Rejection.MALFORMED


def test_the_route_is_planned_once_before_rendering():
    planner = RoutePlanner(gate(), "m")
    assert planner.plan(chat(), None, None).route is Route.RENDER
    assert planner.plan(chat(), None, '{"do_remote_decode": true}').route is Route.REMOTE_PREFILL
    handoff = planner.sign_handoff(chat(max_tokens=5), IDS, kv_handle=HANDLE)
    verified = planner.plan(
        chat(max_tokens=5), None, handoff.to_json()
    )  # the benchmarks' baseline: render, then verify
    assert verified.route is Route.RENDER_VERIFIED
    assert reason(lambda: planner.admit_rendered(verified, IDS[:-1])) is Rejection.BAD_SIGNATURE
    assert planner.admit_rendered(verified, IDS).kv_handle == HANDLE
    handoff = planner.sign_handoff(chat(max_tokens=5), IDS, kv_handle=HANDLE, now=time.time() + 1)  # another handoff
    plan = planner.plan(chat(max_tokens=5), IDS, handoff.to_json())
    assert (plan.route, plan.prompt_token_ids, plan.generation.max_tokens, plan.admission.kv_handle) == (
        Route.REUSE,
        IDS,
        5,
        HANDLE,
    )
    with pytest.raises(InvalidRequest, match="handoff key"):
        RoutePlanner(gate(Policy.OFF, key=None), "m").plan(chat(), None, '{"do_remote_decode": true}')


def test_do_remote_decode_must_be_a_boolean_and_false_renders():
    planner = RoutePlanner(gate(), "m")
    for value in ("false", "null"):
        assert planner.plan(chat(), None, f'{{"do_remote_decode": {value}}}').route is Route.RENDER
    for value, shown in (('"yes"', "'yes'"), ("1", "1")):
        with pytest.raises(InvalidRequest, match=f"do_remote_decode must be true or false, got {shown}$"):
            planner.plan(chat(), None, f'{{"do_remote_decode": {value}}}')


def test_ids_at_the_top_level_and_inside_kv_transfer_params_are_refused_naming_both():
    planner = RoutePlanner(gate(), "m")
    body = chat(prompt_token_ids=IDS, kv_transfer_params={"prompt_token_ids": IDS})
    with pytest.raises(ForwardedIdsRejected, match="as the top-level prompt_token_ids or inside kv_transfer_params"):
        planner.plan(body, None, None)


def test_a_handoff_refused_for_its_request_s_params_stays_good_for_the_corrected_request():
    planner = RoutePlanner(gate(), "m")
    handoff = planner.sign_handoff(chat(), IDS, kv_handle=HANDLE).to_json()
    with pytest.raises(InvalidRequest, match="max_tokens"):
        planner.plan(chat(max_tokens=10_000), IDS, handoff)  # past the context: refused after the gate admitted
    plan = planner.plan(chat(max_tokens=5), IDS, handoff)
    assert plan.route is Route.REUSE and plan.admission.kv_handle == HANDLE
    plan.admission.spend()
    assert reason(lambda: planner.plan(chat(max_tokens=5), IDS, handoff)) is Rejection.REPLAYED
