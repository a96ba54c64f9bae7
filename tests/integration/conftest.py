"""Real tritonservers on the tiny model, shared by the integration tests.

A server start is the suite's dearest step (about 25 s on 2 cores), so servers with one
configuration are session fixtures here, whichever files use them; where tests need
settings that do not interfere (a small pool and KV events; one decode slot and request
templates) one server carries both. Stopping takes seconds too: a fixture's server is
stopped in the background while the next tests run, and every stop is joined and checked
(no shared memory left) at the end of the session.

Besides the repository's models `server` serves an extra repository with `prefill_bad`,
a prefill pointed at a model path that does not exist, loaded on demand only.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable

import pytest

from pdchat.clients.chat import GrpcChat, HttpChat
from pdchat.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, each_in_a_thread, free_port

ENSEMBLE = "chat_ensemble"
MODELS = ("renderer", "prefill", "decode", ENSEMBLE, "chat")
HANDOFF_KEY = "test-handoff-key-0123456789abcdef"
SHORT_TTL_S = 2.0
MISSING_MODEL_PATH = "/nonexistent/model-dir"
# KV pools of the tests' servers: 65k and 32k tokens of the tiny model, room for the
# largest prompt a test sends (~14k tokens, test_prefix_cache), at a quarter of the default
# memory (1 GiB and 512 MiB, resident from the load): several servers are up at once on a
# machine of 23 GiB.
TEST_POOLS = {"PDCHAT_DECODE_KV_MB": "256", "PDCHAT_PREFILL_KV_MB": "128"}
# decode_server's served model names: the tiny model's own name first, and an alias.
SERVED_NAMES = ("tiny-llama", "tiny-chat")
GRAMMAR_COMPILE_TIMEOUT_S = 6.0
GRAMMAR_ENV = {
    "PDCHAT_GRAMMAR_COMPILE_TIMEOUT_S": str(GRAMMAR_COMPILE_TIMEOUT_S),
    "PDCHAT_GRAMMAR_MAX_ENUM_VALUES": "200000",
    "PDCHAT_GRAMMAR_MAX_BYTES": str(4 << 20),
}


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_model_dir):
    extra = tmp_path_factory.mktemp("extra_repository")
    bad = extra / "prefill_bad"
    shutil.copytree(DEFAULT_MODEL_REPOSITORY / "prefill", bad, ignore=shutil.ignore_patterns("__pycache__"))
    config = (bad / "config.pbtxt").read_text().replace('name: "prefill"', 'name: "prefill_bad"')
    (bad / "config.pbtxt").write_text(
        config + f'parameters {{ key: "model" value {{ string_value: "{MISSING_MODEL_PATH}" }} }}\n'
    )
    # An idle decode prefills a lone request itself here (local_prefill_when_idle, the
    # default, pinned: test_local_prefill watches who prefills).
    instance = running_server(
        tmp_path_factory,
        "monolithic",
        load_models=MODELS,
        extra_args=(f"--model-repository={extra}",),
        env={"PDCHAT_LOCAL_PREFILL_WHEN_IDLE": "true"},
    )
    yield instance
    stop_checked(instance)


def running_server(tmp_path_factory, name: str, **options):
    """Start a tiny-model server with TEST_POOLS (unless `env` says otherwise)."""
    env = {"PDCHAT_MODEL": "tiny", **TEST_POOLS, **options.pop("env", {})}
    instance = TritonServer(env=env, log_path=tmp_path_factory.getbasetemp() / f"tritonserver-{name}.log", **options)
    instance.start()
    return instance


def stop_checked(instance: TritonServer) -> None:
    """Stop the server in the background; that it left no shared memory is checked with
    every other stop at the end of the session (`_background_stops`)."""

    def stop() -> None:
        instance.stop()
        assert instance.leaked_shm() == [], f"the {instance.role} server left shared-memory regions behind"

    in_background(stop)


_STOPPING: list[tuple[threading.Thread, list[BaseException]]] = []


def in_background(stop: Callable[[], None]) -> None:
    """Run `stop` (a teardown and its checks) on a thread of its own; what it raises fails
    the session's last teardown."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            stop()
        except BaseException as exc:  # noqa: BLE001 - raised at the session's end
            errors.append(exc)

    thread = threading.Thread(target=run, name="pdchat-test-stop")
    thread.start()
    _STOPPING.append((thread, errors))


@pytest.fixture(scope="session", autouse=True)
def _background_stops():
    """Set up before every other session fixture, so torn down after them: joins every
    background stop (the session servers' too, which thus stop at once) and raises the
    first failure."""
    yield
    for thread, _ in _STOPPING:
        thread.join(120)
    assert not any(thread.is_alive() for thread, _ in _STOPPING), "a server's stop did not end within 120 s"
    errors = [error for _, errors in _STOPPING for error in errors]
    _STOPPING.clear()
    if errors:
        raise errors[0]


def at_once(calls: list[Callable[[], object]]) -> None:
    """Make the calls at once, a thread each (servers start or stop in parallel); raise the
    first failure once all are done."""
    errors = each_in_a_thread(calls)
    if errors:
        raise errors[0]


@pytest.fixture(scope="session")
def decode_server(tmp_path_factory, tiny_model_dir):
    """Decode role: chat accepts forwarded ids signed with the shared key, and signs its own
    prefill legs (do_remote_decode), so it serves both legs of a P/D request. Served as
    SERVED_NAMES (its own name first, so an answer names the model as without them).
    decode's scheduler thread on a CPU of its own (decode_cpus auto: test_placement)."""
    env = {
        "PDCHAT_HANDOFF_KEY": HANDOFF_KEY,
        "PDCHAT_SERVED_MODEL_NAME": ",".join(SERVED_NAMES),
        "PDCHAT_DECODE_CPUS": "auto",
    }
    instance = running_server(tmp_path_factory, "decode", role="decode", env=env)
    yield instance
    stop_checked(instance)


@pytest.fixture(scope="session")
def trusted_server(tmp_path_factory, tiny_model_dir):
    """Policy trusted (unsigned ids accepted), with a key and a short handoff TTL; output
    grammars up to GRAMMAR_ENV's limits, compiles up to GRAMMAR_COMPILE_TIMEOUT_S."""
    env = {
        "PDCHAT_HANDOFF_KEY": HANDOFF_KEY,
        "PDCHAT_FORWARDED_IDS": "trusted",
        "PDCHAT_HANDOFF_TTL_S": str(SHORT_TTL_S),
        **GRAMMAR_ENV,
    }
    instance = running_server(tmp_path_factory, "trusted", env=env)
    yield instance
    stop_checked(instance)


@pytest.fixture(scope="session")
def small_pool_server(tmp_path_factory, tiny_model_dir):
    """Small KV pools, and KV events: decode's pool is 4 MiB (1,024 tokens of the tiny model's
    KV, 64 blocks) with a 2 s queue timeout; prefill's is 2 MiB (32 blocks of 16 tokens, so
    three ~220-token prompts evict) and computes prompts in passes of 64 tokens, so several
    are in its pool at once; it publishes its events on `kv_events` (pub, replay).
    With decode_server's key, so a router can use it as a prefill server. Its prompts are
    always prefill's (local_prefill_when_idle off): its tests watch prefill's pool."""
    pub, replay = free_port(), free_port()
    env = {
        "PDCHAT_DECODE_KV_MB": "4",
        "PDCHAT_QUEUE_TIMEOUT_S": "2",
        "PDCHAT_PREFILL_KV_MB": "2",
        "PDCHAT_PREFILL_PASS_TOKENS": "64",
        "PDCHAT_PREFILL_KV_EVENTS_ENDPOINT": f"tcp://*:{pub}",
        "PDCHAT_PREFILL_KV_EVENTS_REPLAY_ENDPOINT": f"tcp://*:{replay}",
        "PDCHAT_HANDOFF_KEY": HANDOFF_KEY,
        "PDCHAT_LOCAL_PREFILL_WHEN_IDLE": "false",  # these tests need every prompt through prefill
    }
    instance = running_server(tmp_path_factory, "small-pool", env=env)
    instance.kv_events = (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    yield instance
    stop_checked(instance)


ONE_SLOT_RENDER_BOUND_S = 1.0


@pytest.fixture(scope="session")
def one_slot_server(tmp_path_factory, tiny_model_dir):
    """Decode runs one request at a time and a request waits 1 s for the slot (its pool, of
    8k tokens, has room for more: the slot is the limit); the operator allows request
    templates, each render bounded by ONE_SLOT_RENDER_BOUND_S."""
    env = {
        "PDCHAT_DECODE_KV_MB": "32",  # 8k tokens: room for its requests, and little memory
        "PDCHAT_PREFILL_KV_MB": "16",
        "PDCHAT_MAX_RUNNING": "1",
        "PDCHAT_QUEUE_TIMEOUT_S": "1",
        "PDCHAT_ALLOW_REQUEST_TEMPLATES": "1",
        "PDCHAT_RENDER_TIMEOUT_S": str(ONE_SLOT_RENDER_BOUND_S),
    }
    instance = running_server(tmp_path_factory, "one-slot", env=env)
    yield instance
    stop_checked(instance)


@pytest.fixture(params=["grpc", "http"])
def protocol(request):
    return request.param


@pytest.fixture
def chat_client(server, protocol):
    client = GrpcChat(server.grpc_url, ENSEMBLE) if protocol == "grpc" else HttpChat(server.http_url, ENSEMBLE)
    yield client
    client.close()


@pytest.fixture(scope="session")
def grpc_chat(server):
    client = GrpcChat(server.grpc_url, ENSEMBLE)
    yield client
    client.close()
