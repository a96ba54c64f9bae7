"""engine=vllm: vLLM's AsyncLLM under pdchat's Triton models, on the tiny model on CPU.

A prefill server and a decode server with setting engine vllm (vLLM's NixlConnector moves
the KV between their engines) and pdchat's router: the gate, seals, renderer, router and
fronts are pdchat's, unchanged. `make test-vllm` runs these (scripts/bootstrap.sh --vllm
builds the env the servers' models run in); elsewhere they are skipped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid

import pytest

from benchmarks import load
from pdchat import tensors
from pdchat.clients.chat import ChatError, chat_inputs
from pdchat.launcher import PDStack, process_group
from tests.conversations import PARITY_CASES, SAMPLING_CASES
from tests.integration import soak
from tests.integration.adversarial import ADVERSARIAL
from tests.integration.helpers import (
    ask,
    chat_renders,
    forwarded,
    metric,
    pd_clients,
    post,
    prefill_leg,
    prompt_tokens_computed,
    refusal,
    responses,
    router_answer,
    router_responses,
    summary,
    wait_for,
)
from tests.integration.vllm_servers import ENGINE_ENV, PYTHON, VLLM_TESTS
from tests.logprobs import assert_logprobs_close, logprobs_of

pytestmark = VLLM_TESTS
CASES = ["single_turn", "multi_turn", "unicode_emoji", "tool_required", "json_schema", "long_prompt"]
# vLLM's own offline engine on the same ids: what engine=vllm's greedy answer must equal.
REFERENCE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import tokens_input
model, ids, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
if __name__ == "__main__":
    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, detokenize=False, ignore_eos=True)
    [output] = llm.generate([tokens_input(ids)], params, use_tqdm=False)
    print("IDS", json.dumps(list(output.outputs[0].token_ids)), flush=True)
"""


# ipc: a TCP port chosen now could be handed to a server's own port before decode binds it.
KV_EVENTS = f"ipc://{tempfile.gettempdir()}/pdchat-vllm-kv-events-{os.getpid()}"
TOPIC = b"kv-events"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    events = {"PDCHAT_DECODE_KV_EVENTS_ENDPOINT": KV_EVENTS, "PDCHAT_KV_EVENTS_TOPIC": TOPIC.decode()}
    env = {**ENGINE_ENV, **events}
    instance = PDStack(model="tiny", env=env, log_dir=tmp_path_factory.mktemp("vllm-pd-logs"))
    instance.start()
    yield instance
    instance.stop()
    engine_cores = subprocess.run(["pgrep", "-f", "VLLM::EngineCore"], capture_output=True, text=True).stdout.split()
    for server in (instance.prefill, instance.decode):
        assert server.leaked_shm() == []
    assert not [pid for pid in engine_cores if _in_group(int(pid), instance)], "an engine core outlived its server"


def _in_group(pid: int, stack) -> bool:
    try:
        return os.getpgid(pid) in (stack.prefill.process.pid, stack.decode.process.pid)
    except OSError:
        return False


@pytest.fixture(scope="module")
def clients(stack):
    with pd_clients(stack) as made:
        yield made


def test_a_greedy_answer_equals_vllms_own_generate_on_the_same_ids(stack, clients, tiny_model_dir):
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, **PARITY_CASES["multi_turn"]}
    served = ask(clients["grpc"], body)
    reference = subprocess.run(
        [PYTHON, "-c", REFERENCE, str(tiny_model_dir), json.dumps(served.prompt_token_ids), "24"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert reference.returncode == 0, reference.stderr[-2000:]
    [ids] = [line[4:] for line in reference.stdout.splitlines() if line.startswith("IDS ")]
    assert served.output_token_ids == json.loads(ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", CASES)
def test_pd_answers_equal_the_decode_servers_own_and_decode_neither_renders_nor_computes_the_prompt(
    stack, clients, case, stream
):
    body = {"max_tokens": 12, "temperature": 0, "stream": stream, **PARITY_CASES[case]}
    plain = ask(clients["grpc"], body)
    handed = prefill_leg(clients, body)
    renders, computed = chat_renders(stack.decode), prompt_tokens_computed(stack.decode)["decode"]
    reused = ask(clients["http"], body, **forwarded(handed))
    assert reused.output_token_ids == plain.output_token_ids and reused.text == plain.text
    assert reused.finish_reason == plain.finish_reason
    assert chat_renders(stack.decode) == renders, "decode rendered a prompt it was handed"
    # The KV came over vLLM's NixlConnector: decode computed at most the last block's tail.
    grown = prompt_tokens_computed(stack.decode)["decode"] - computed
    assert grown < len(handed.prompt_token_ids) and grown <= 128


def test_the_router_serves_pd_on_vllms_engine_as_the_decode_server_alone(stack, clients):
    body = {"max_tokens": 12, "temperature": 0, "return_token_ids": True, **PARITY_CASES["long_prompt"]}
    plain = ask(clients["grpc"], body)
    answer = router_answer(stack, body)
    assert answer["ids"] == plain.output_token_ids
    assert router_answer(stack, {**body, "stream": True})["ids"] == plain.output_token_ids


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampling_fields_and_logprobs_are_the_same_through_pd(clients, case):
    body = {**SAMPLING_CASES[case], "seed": 11}
    plain = ask(clients["grpc"], body)
    reused = ask(clients["grpc"], body, **forwarded(prefill_leg(clients, body)))
    assert reused.output_token_ids == plain.output_token_ids
    got = logprobs_of(responses(reused))
    assert len(got) == len(reused.output_token_ids)
    assert all(len(entry["top_logprobs"]) == body["top_logprobs"] for entry in got)
    assert_logprobs_close(got, logprobs_of(responses(plain)))


def test_stop_strings_json_schema_and_tools_hold_through_pd(clients):
    first = ask(clients["grpc"], {"max_tokens": 12, "temperature": 0, **PARITY_CASES["single_turn"]})
    stop = first.text.split()[2]
    body = {"max_tokens": 12, "temperature": 0, "stop": [stop], **PARITY_CASES["single_turn"]}
    for answer in (ask(clients["grpc"], body), ask(clients["grpc"], body, **forwarded(prefill_leg(clients, body)))):
        assert answer.finish_reason == "stop" and stop not in answer.text
        assert first.text.startswith(answer.text)

    schema = {"max_tokens": 40, "temperature": 0, **PARITY_CASES["json_schema"]}
    answer = ask(clients["grpc"], schema, **forwarded(prefill_leg(clients, schema)))
    if answer.finish_reason == "stop":  # a schema's JSON, once complete
        assert isinstance(json.loads(summary(answer)["content"]), dict)

    tools = {"max_tokens": 40, "temperature": 0, **PARITY_CASES["tool_required"]}
    answer = ask(clients["grpc"], tools, **forwarded(prefill_leg(clients, tools)))
    [(name, arguments)] = summary(answer)["tool_calls"]
    assert name in {tool["function"]["name"] for tool in tools["tools"]} and isinstance(arguments, dict)


def test_n_choices_through_the_router(stack):
    body = {"max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 2, **PARITY_CASES["single_turn"]}
    [reply] = router_responses(stack, body)
    assert [choice["index"] for choice in reply["choices"]] == [0, 1]
    assert all(choice["finish_reason"] in ("length", "stop") for choice in reply["choices"])


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_the_gate_refuses_on_vllms_engine_what_it_refuses_on_pdchats(clients, case):
    body = {"max_tokens": 4, "temperature": 0, **PARITY_CASES["single_turn"]}
    handed = prefill_leg(clients, body)
    make, reason = ADVERSARIAL[case]
    assert f"forwarded prompt token ids refused ({reason})" in refusal(clients["grpc"], body, **make(handed))
    assert ask(clients["grpc"], body, **forwarded(handed)).finish_reason in ("length", "stop")


def test_a_prefill_leg_sent_to_the_decode_server_is_refused_saying_why(clients):
    body = {"max_tokens": 4, "temperature": 0, **PARITY_CASES["single_turn"]}
    message = refusal(clients["grpc"], body, kv_transfer_params={"do_remote_decode": True})
    assert "does not serve the prefill stage" in message and "Traceback" not in message
    assert ask(clients["grpc"], body).finish_reason == "length"


def test_first_output_sent_is_refused_where_prefill_gives_no_first_output(clients):
    """vLLM's decode makes the first token again and prefill shows none: a decode leg saying
    the client has it would drop the answer's first token unseen."""
    body = {"max_tokens": 4, "temperature": 0, **PARITY_CASES["single_turn"]}
    handed = prefill_leg(clients, body)
    with pytest.raises(ChatError) as info:
        ask_with(clients["grpc"], body, {tensors.FIRST_OUTPUT_SENT: True}, **forwarded(handed))
    assert f"'{tensors.FIRST_OUTPUT_SENT}': engine vllm sends no first output" in str(info.value)
    assert ask(clients["grpc"], body, **forwarded(prefill_leg(clients, body))).finish_reason == "length"


def ask_with(client, body: dict, parameters: dict, **inputs):
    return list(client.stream(chat_inputs(body, **inputs), parameters=parameters))


def test_a_replayed_handoff_is_refused(clients):
    body = {"max_tokens": 4, "temperature": 0, **PARITY_CASES["multi_turn"]}
    handed = prefill_leg(clients, body)
    ask(clients["grpc"], body, **forwarded(handed))
    assert "forwarded prompt token ids refused (replayed)" in refusal(clients["grpc"], body, **forwarded(handed))


def long_chat(salt: str | None = None) -> dict:
    system = "You answer briefly and precisely about lighthouses and their keepers. " * 40
    return {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Why are they tall?"}],
        "max_tokens": 2,
        "temperature": 0,
        **({"cache_salt": salt} if salt else {}),
    }


def test_vllms_prefix_cache_hits_show_in_cached_tokens_and_a_salt_keeps_them_apart(clients):
    body = long_chat(salt=f"salt-{uuid.uuid4()}")
    first, again = ask(clients["grpc"], body), ask(clients["grpc"], body)
    assert summary_usage(first)["cached_tokens"] == 0
    assert summary_usage(again)["cached_tokens"] >= len(again.prompt_token_ids) // 2
    other = ask(clients["grpc"], {**body, "cache_salt": f"salt-{uuid.uuid4()}"})
    assert summary_usage(other)["cached_tokens"] == 0


def summary_usage(result) -> dict:
    usage = responses(result)[-1]["usage"]
    return {"prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def test_vllms_kv_events_come_out_on_pdchats_endpoint(clients):
    import msgspec
    import zmq

    from tests.kv_event_types import BlockStored, KVEventBatch

    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(KV_EVENTS)
    try:
        time.sleep(0.3)  # the subscription reaches the server
        answer = ask(clients["grpc"], long_chat(salt=f"events-{uuid.uuid4()}"))
        decoder, stored = msgspec.msgpack.Decoder(KVEventBatch), []
        while sub.poll(2000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC and len(seq) == 8
            stored += [e for e in decoder.decode(payload).events if isinstance(e, BlockStored)]
    finally:
        context.destroy(linger=0)
    assert stored, "no BlockStored event from vLLM's publisher"
    block = stored[0].block_size
    tokens = [token for event in stored for token in event.token_ids]
    full = len(answer.prompt_token_ids) // block * block
    assert tokens[:full] == answer.prompt_token_ids[:full]


def test_no_engine_thread_is_pinned_narrower_than_its_server(stack):
    """vLLM's NIXL worker pins its thread (the forward pass's) to the last core on a CPU;
    pdchat's plugin keeps every engine thread on its server's CPUs (docs/engines.md)."""
    for server in (stack.prefill, stack.decode):
        allowed = _cpus_allowed(server.process.pid)
        cores = [pid for pid in process_group(server.process.pid) if _name(pid) == "VLLM::EngineCor"]
        assert cores, f"no engine core in the {server.role} server"
        for pid in cores:
            threads = {tid: _cpus_allowed(pid, tid) for tid in os.listdir(f"/proc/{pid}/task")}
            assert set(threads.values()) == {allowed}, threads


def _cpus_allowed(pid: int, tid: str | None = None) -> str:
    path = f"/proc/{pid}/status" if tid is None else f"/proc/{pid}/task/{tid}/status"
    with open(path) as status:
        return next(line.split()[-1] for line in status if line.startswith("Cpus_allowed_list"))


def _name(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as comm:
        return comm.read().strip()


def test_a_client_leaving_aborts_vllms_request(stack):
    reply = post(
        stack,
        {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 3000, "ignore_eos": True, "stream": True},
    )
    for _ in range(4):
        reply.readline()
    # NOTE: the gauge follows the engine's state at most 0.1 s late (StateReports), so it is awaited.
    assert wait_for(lambda: metric(stack.decode, "vllm:num_requests_running") >= 1, timeout=10)
    reply.close()
    assert wait_for(lambda: metric(stack.decode, "vllm:num_requests_running") == 0, timeout=30)
    assert wait_for(lambda: metric(stack.decode, "pdchat_decode_active") == 0)


def test_a_sampled_request_with_a_long_prompt_is_served_plain_and_through_pd(stack, clients):
    """A seeded draw after a prompt longer than vLLM's default batch budget (2,048 tokens):
    prefilled in chunks, it failed vLLM's CPU engine core (pdchat turns chunking off on CPU)."""
    body = {
        "messages": [{"role": "user", "content": "harbour pilot diary " * 900}],
        "max_tokens": 4,
        "temperature": 0.8,
    }
    plain = ask(clients["grpc"], {**body, "seed": 5})
    assert len(plain.prompt_token_ids) > 2048 and len(plain.output_token_ids) == 4
    through_router = router_answer(stack, {**body, "seed": 5, "return_token_ids": True})
    assert through_router["ids"] == plain.output_token_ids
    assert ask(clients["grpc"], {"max_tokens": 2, **PARITY_CASES["single_turn"]}).finish_reason == "length"


def test_pd_on_vllms_engine_soaks_through_the_router(stack):
    """tests/integration/soak.py's soak (hundreds of streams at concurrency 16, then streams
    abandoned mid-way) through the router, then no request left in either engine."""
    soak.soak(load.RouterStreams(stack.router_url), [stack.prefill, stack.decode], stack.decode, abandon_cancels=True)
    for server in (stack.prefill, stack.decode):
        assert wait_for(lambda s=server: metric(s, "vllm:num_requests_running") == 0, timeout=30)


def test_prefill_killed_under_load_fails_no_request(stack, clients):
    """Last: it kills the prefill server. Answers whose KV went with it are recomputed by
    decode from their ids (vLLM's kv_load_failure_policy recompute), the rest run on decode."""
    body = {"max_tokens": 12, "temperature": 0, "return_token_ids": True, **PARITY_CASES["long_prompt"]}
    expected = ask(clients["grpc"], body).output_token_ids
    handed = [prefill_leg(clients, body) for _ in range(4)]  # KV held by prefill's engine, not yet pulled
    answers, errors = [], []

    def one() -> None:
        try:
            answers.append(router_answer(stack, body)["ids"])
        except Exception as exc:  # noqa: BLE001 - counted, not raised on a thread
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads[:4]:
        thread.start()
    os.killpg(stack.prefill.process.pid, signal.SIGKILL)
    stack.prefill.process.wait()
    for thread in threads[4:]:
        thread.start()
    reused = [ask(clients["grpc"], body, **forwarded(h)).output_token_ids for h in handed]
    for thread in threads:
        thread.join(180)
    assert errors == []
    assert answers == [expected] * 8 and reused == [expected] * 4
    stack.prefill.cleanup_shm()
