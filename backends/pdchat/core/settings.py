"""Every pdchat setting, declared once: its config.pbtxt parameter, its environment
variable, its default, its type, what reads it.

A model resolves a setting from the parameter if its config.pbtxt sets one, else from the
environment variable, else from the default; an empty value counts as unset. Every model
resolves the same way, so renderer, prefill and decode agree on one model without
repeating it in several config.pbtxt files. Settings without a parameter (keys, the cache
directory) come from the environment only.

The launcher, the CLI and the tests take the names from this table, and
docs/configuration.md lists it: `python -m pdchat.core.settings --write docs/configuration.md`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from pdchat import registry
from pdchat.core.errors import ModelUnavailable
from pdchat.core.placement import CpuPlacement, allowed_cpus, bind_process, parse_cpus

T = TypeVar("T")
MIB = 1 << 20


@dataclass(frozen=True)
class Kind(Generic[T]):
    """A setting's type: what its text may say (`spelling`, a noun phrase for messages and
    the docs) and how the text becomes a value (`parse`, which raises ValueError saying
    what the text must be)."""

    spelling: str
    parse: Callable[[str], T]


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("must be a number") from None
    if not value > 0:
        raise ValueError("must be positive")
    return value


def _integer_from(least: int) -> Callable[[str], int]:
    """Parses an integer of at least `least` (1: positive, 0: not negative)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("must be an integer") from None
        if value < least:
            raise ValueError("must be positive" if least == 1 else f"must be {least} or more")
        return value

    return parse


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(text: str) -> bool:
    flag = text.strip().lower()
    if flag not in _TRUE + _FALSE:
        raise ValueError(f"must be one of {', '.join(_TRUE + _FALSE)}")
    return flag in _TRUE


def choice(*choices: str) -> Kind[str]:
    """One of `choices`, spelt exactly."""
    listed = ", ".join(choices)

    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {listed}")
        return text

    return Kind(f"one of {listed}", parse)


def or_auto(kind: Kind[T]) -> Kind[T | None]:
    """`auto` (None: the reader picks) or a value of `kind`."""

    def parse(text: str) -> T | None:
        if text == "auto":
            return None
        try:
            return kind.parse(text)
        except ValueError:
            raise ValueError(f"must be auto or {kind.spelling}") from None

    return Kind(f"auto or {kind.spelling}", parse)


TEXT: Kind[str] = Kind("text", str)


def _names(text: str) -> tuple[str, ...]:
    if not text:
        return ()  # unset
    names = tuple(name.strip() for name in text.split(","))
    if not all(names) or len(set(names)) != len(names):
        raise ValueError("must be distinct non-empty names, separated by commas")
    return names


NAMES: Kind[tuple[str, ...]] = Kind("names separated by commas", _names)
PATH: Kind[str] = Kind("a path (~ expands)", os.path.expanduser)
NUMBER: Kind[float] = Kind("a positive number", _number)
INTEGER: Kind[int] = Kind("a positive integer", _integer_from(1))
COUNT: Kind[int] = Kind("an integer, 0 or more", _integer_from(0))
FLAG: Kind[bool] = Kind(f"a boolean: {', '.join(_TRUE)} or {', '.join(_FALSE)}", _flag)


def _endpoint(text: str) -> str:
    if text and not text.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError("must be a ZMQ endpoint: tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    return text


ENDPOINT: Kind[str] = Kind("a ZMQ endpoint (tcp://*:PORT binds, tcp://HOST:PORT connects; ipc://PATH)", _endpoint)


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One setting. `name` is how messages and the docs call it; `param` its key in a
    model's config.pbtxt `parameters` (None: the environment only); `env` its environment
    variable; `default` the text used when neither is set ("" where unset means none);
    `type` what the text may say; `applies_to` the Triton models or pdchat commands that
    read it; `doc` what it does, one paragraph for the docs' table."""

    name: str
    param: str | None
    env: str
    default: str
    type: Kind[T]
    applies_to: tuple[str, ...]
    doc: str

    @property
    def names(self) -> str:
        """How a message points an operator at this setting: "parameter x / PDCHAT_X"."""
        return self.env if self.param is None else f"parameter {self.param} / {self.env}"

    @property
    def default_value(self) -> T:
        """The default, parsed: what a model gets when nothing sets this setting."""
        return self.parse(self.default, "the default")

    def get(self, parameters: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None) -> T:
        """This setting's value for a model with config `parameters`: the parameter if they
        set it, else the variable in `environ` (this process's environment if None), else
        the default; an empty value counts as unset. Raises ModelUnavailable, naming the
        setting and where the text came from, if that text is not of the setting's type."""
        found = self._text(parameters, environ)
        return self.default_value if found is None else self.parse(*found)

    def set_by(
        self, parameters: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None
    ) -> str | None:
        """Where this setting is set for a model with config `parameters` ("config parameter x"
        or its variable's name, as `get` reads them), None where it takes its default."""
        found = self._text(parameters, environ)
        return None if found is None else found[1]

    def _text(self, parameters: Mapping[str, str] | None, environ: Mapping[str, str] | None) -> tuple[str, str] | None:
        """(the text that sets this setting, where it came from), or None: unset. NOTE: an
        empty value counts as unset."""
        configured = parameters.get(self.param) if parameters and self.param else None
        if configured:
            return configured, f"config parameter {self.param}"
        exported = (os.environ if environ is None else environ).get(self.env)
        return (exported, self.env) if exported else None

    def parse(self, text: str, source: str) -> T:
        """`text` as this setting's type; `source` says where the text came from if it is not."""
        try:
            return self.type.parse(text)
        except ValueError as exc:
            raise ModelUnavailable(f"{self.name} {exc}, got {text!r} ({source})") from None


# The model and where it runs.
MODEL = Setting(
    "model",
    "model",
    "PDCHAT_MODEL",
    registry.DEFAULT_MODEL,
    TEXT,
    ("chat", "renderer", "prefill", "decode"),
    f"The model served: an embedded model ({', '.join(registry.EMBEDDED_MODELS)}, built into the cache on "
    "first use) or a Hugging Face causal-LM directory.",
)
SERVED_MODEL_NAME = Setting(
    "served_model_name",
    "served_model_name",
    "PDCHAT_SERVED_MODEL_NAME",
    "",
    NAMES,
    ("chat", "renderer", "router", "openai"),
    "The names clients may give as the request's `model` (vLLM's `--served-model-name`; `--served-model-name` "
    "on `pdchat serve`, `pd`, `router` and `openai` sets it): `GET /v1/models` lists them, responses report the "
    "first, any other name gets 404 model_not_found. Unset: the model directory's name (embedded: "
    "`SmolLM2-135M-Instruct`, `tiny-llama`, ...); on the router and `pdchat openai`, the name a server reports, "
    "the servers checking the names.",
)
DEVICE = Setting(
    "device",
    "device",
    "PDCHAT_DEVICE",
    "auto",
    TEXT,
    ("prefill", "decode"),
    "Where the model runs: auto (CUDA when torch sees it), cpu or cuda. A KIND_GPU instance runs on the GPU "
    "Triton gave it and takes only auto or cuda.",
)
DTYPE = Setting(
    "dtype",
    "dtype",
    "PDCHAT_DTYPE",
    "auto",
    choice("auto", "float32", "bfloat16", "float16"),
    ("prefill", "decode"),
    "The model's dtype, which its KV travels in: auto is bfloat16 on CUDA, float32 on CPU. Prefill and decode "
    "servers of one deployment must agree.",
)
FORWARD = Setting(
    "forward",
    "forward",
    "PDCHAT_FORWARD",
    "auto",
    choice("auto", "transformers"),
    ("prefill", "decode"),
    "Which forward pass runs the model. auto: pdchat's own for Llama-architecture models in float32 (transformers' "
    "numbers to rounding, in fewer ops, its projections on oneDNN's blocked weights, each row's result the same "
    "bits in any batch) and, on CPU in float32, decode's work between its GEMMs, a prompt's attention (AVX-512) "
    "and its greedy argmax in C on the pass's threads (the same to rounding), built at setup by `pdchat prepare "
    "kernels` into cache_dir (a server that finds no build for its host "
    "logs so and builds it at load with the host's C compiler; the torch path where none is found); "
    "transformers: transformers' forward with torch attention, for every model "
    "(docs/architecture.md#the-forward-pass).",
)
ENGINE = Setting(
    "engine",
    "engine",
    "PDCHAT_ENGINE",
    "pdchat",
    choice("pdchat", "vllm"),
    ("chat", "prefill", "decode", "pdchat"),
    "The engine under the prefill and decode models: pdchat (its own, for CPU hosts) or vllm (vLLM's AsyncLLM: "
    "its kernels, models and GPU support, KV over its NixlConnector; installed apart, see docs/engines.md). With "
    "vllm, chat gives decode every rendered prompt to compute itself (prefill serves only remote prefill), so a "
    "server loads the one engine its role uses.",
)
VLLM_ENGINE_ARGS = Setting(
    "vllm_engine_args",
    "vllm_engine_args",
    "PDCHAT_VLLM_ENGINE_ARGS",
    "",
    TEXT,
    ("prefill", "decode"),
    "With engine vllm: vLLM's engine arguments (AsyncEngineArgs) as a JSON object, or the path of a JSON file "
    "holding one, as vllm_backend's model.json (dtype, max_model_len, gpu_memory_utilization, "
    "tensor_parallel_size, enforce_eager, block_size, kv_transfer_config, ...), over what pdchat derives from its "
    "own settings (docs/engines.md).",
)
VLLM_KV_CONNECTOR = Setting(
    "vllm_kv_connector",
    "vllm_kv_connector",
    "PDCHAT_VLLM_KV_CONNECTOR",
    "true",
    FLAG,
    ("prefill", "decode", "pdchat"),
    "With engine vllm: give the engine vLLM's NixlConnector, which a P/D pair's prefill and decode servers need. "
    "The launcher sets it false on a server that serves alone, which has no KV to move.",
)
VLLM_VENV = Setting(
    "vllm_venv",
    None,
    "PDCHAT_VLLM_VENV",
    "",
    TEXT,
    ("pdchat",),
    "With engine vllm: the venv (vLLM and pdchat) the launcher runs the servers' models in; unset: the checkout's "
    ".venv-vllm (scripts/bootstrap.sh --vllm) where it exists, else the launcher's own python.",
)
TORCH_THREADS = Setting(
    "torch_threads",
    "torch_threads",
    "PDCHAT_TORCH_THREADS",
    "auto",
    or_auto(INTEGER),
    ("prefill", "decode"),
    "torch's CPU threads in each stage model; auto is half the cores this process may run on (its affinity), "
    "at least 1. Prefill and decode share a server's cores: each taking all of them makes their OpenMP "
    "threads spin against each other.",
)

PREFILL_THREADS_WHEN_IDLE = Setting(
    "prefill_threads_when_idle",
    "prefill_threads_when_idle",
    "PDCHAT_PREFILL_THREADS_WHEN_IDLE",
    "auto",
    or_auto(INTEGER),
    ("prefill", "decode"),
    "The most torch threads a prompt's pass takes. prefill adds one to torch_threads before each pass per core of "
    "its own that sat idle since the pass before (/proc/stat; 0.6 of a core counts), so a lone prompt on a quiet "
    "server takes the cores decode leaves free, and a busy server's passes keep torch_threads. decode takes them "
    "all for a prompt it prefills itself while no row runs (chat sends it one only while the server is idle: "
    "local_prefill_when_idle); its steps keep torch_threads. auto: every core this process may run on; "
    "torch_threads or fewer: off (docs/batching.md#prefill).",
)
PREFILL_TAKES_CORES_MS = Setting(
    "prefill_takes_cores_ms",
    "prefill_takes_cores_ms",
    "PDCHAT_PREFILL_TAKES_CORES_MS",
    "40",
    COUNT,
    ("prefill", "decode"),
    "A prompt pass in prefill expected to take at least this many milliseconds on every core (its tokens at the "
    "core-seconds per token of the passes before it) takes the cores in turns with decode, as vLLM's steps do: "
    "it runs on prefill_threads_when_idle threads while the decodes in use on those cores (this server's, or "
    "another server's on the same host: a P/D pair) wait for it before their next step (up to 1.5 times what "
    "the pass is expected to take, within 0.25-2 s, and stepping once between two passes of a long prompt), so "
    "first tokens come sooner under load, each running "
    "row waiting up to one pass. Shorter passes run beside decode's steps on torch_threads. A decode with a CPU "
    "of its own (decode_cpus), or with this setting at 0, does not wait, and while it holds sequences no pass "
    "takes the cores. 0: never (docs/batching.md#prefill).",
)


def cores_in_turns(parameters: Mapping[str, str], environ: Mapping[str, str] | None = None) -> bool:
    """Whether a prefill or decode model takes the cores in turns (setting prefill_takes_cores_ms
    above 0, on pdchat's engine: vLLM's schedules by its own rules)."""
    return PREFILL_TAKES_CORES_MS.get(parameters, environ) > 0 and ENGINE.get(parameters, environ) == "pdchat"


def _cpus(text: str) -> frozenset[int] | str:
    return text if text in ("auto", "none") else parse_cpus(text)


DECODE_CPUS = Setting(
    "decode_cpus",
    "decode_cpus",
    "PDCHAT_DECODE_CPUS",
    "none",
    Kind("auto, none or a CPU list such as 3 or 2-3,6", _cpus),
    ("chat", "renderer", "prefill", "decode", "router", "openai"),
    "The CPUs decode's scheduler thread runs on alone (its torch threads with it); every other thread of the "
    "server's models, and the router's and `pdchat openai`'s, keeps off them. auto: the last CPUs this process "
    "may run on, as many as decode's torch threads, when at least one is left; none: no binding. A trade: "
    "steadier steps under load, less CPU for prefill and the rest (docs/deployment.md#cpu-placement). "
    "tritonserver's own threads keep their affinity: start it under `taskset` to keep them off too.",
)
CACHE_DIR = Setting(
    "cache_dir",
    None,
    "PDCHAT_CACHE_DIR",
    "~/.cache/pdchat",
    PATH,
    ("chat", "renderer", "prefill", "decode", "pdchat"),
    "Root of generated artefacts: embedded models, the assembled backend directory, each server's stage key, "
    "launcher logs, the C decode kernels (kernels/).",
)

# chat: the gate, the handoff, its calls to the stage models.
FORWARDED_IDS = Setting(
    "forwarded_ids",
    "forwarded_ids",
    "PDCHAT_FORWARDED_IDS",
    "off",
    choice("off", "signed", "trusted"),
    ("chat",),
    "Which forwarded prompt token ids chat admits: off (none; it renders the conversation itself), signed "
    "(only ids a prefill server signed with the handoff key), trusted (any, still checked against the vocabulary).",
)
HANDOFF_TTL_S = Setting(
    "handoff_ttl_s",
    "handoff_ttl_s",
    "PDCHAT_HANDOFF_TTL_S",
    "60",
    NUMBER,
    ("chat",),
    "Seconds a signed handoff (ids and KV handle) a prefill server hands out stays valid.",
)
KV_CONNECTOR = Setting(
    "kv_connector",
    "kv_connector",
    "PDCHAT_KV_CONNECTOR",
    registry.SHM,
    choice(*registry.KV_CONNECTORS),
    ("chat",),
    "What a prefill server publishes KV through: shm (shared memory, same host) or nixl (NIXL over UCX, across hosts).",
)
STAGE_LANES = Setting(
    "stage_lanes",
    "stage_lanes",
    "PDCHAT_STAGE_LANES",
    "16",
    INTEGER,
    ("chat",),
    "Blocking calls chat makes to renderer and prefill at once (a thread each). Prefill gives each pass to the "
    "prompt with the fewest passes left and computes a burst's short prompts in one pass, so the prompts of a "
    "burst are answered soonest when each has a lane of its own: with fewer lanes than the burst, the rest reach "
    "prefill only as the first ones finish.",
)
STAGE_STALL_TIMEOUT_S = Setting(
    "stage_stall_timeout_s",
    "stage_stall_timeout_s",
    "PDCHAT_STAGE_STALL_TIMEOUT_S",
    "45",
    NUMBER,
    ("chat",),
    "Longest chat waits for decode's first response, or for its next one, in seconds; past it the request ends "
    "UNAVAILABLE and decode is told to cancel it. Keep it above queue_timeout_s plus the longest prefill decode "
    "may do itself.",
)
LOCAL_PREFILL_WHEN_IDLE = Setting(
    "local_prefill_when_idle",
    "local_prefill_when_idle",
    "PDCHAT_LOCAL_PREFILL_WHEN_IDLE",
    "true",
    FLAG,
    ("chat",),
    "true: a lone plain request goes to `decode`, which prefills its prompt itself (on the cores that sit idle: "
    "prefill_threads_when_idle), while decode holds no sequence: its first token skips prefill's call and the KV "
    "copy between the two. Requests served together still go to `prefill`. false: every prompt is prefill's "
    "(docs/benchmarks.md#an-idle-decode-prefills-a-lone-prompt). Forwarded ids and P/D prefill legs are not affected.",
)
CHAT_RENDER_MAX_CHARS = Setting(
    "chat_render_max_chars",
    "chat_render_max_chars",
    "PDCHAT_CHAT_RENDER_MAX_CHARS",
    "8192",
    COUNT,
    ("chat",),
    "Longest request (in the characters its render writes: contents, reasoning, tool calls, tools) that chat renders "
    "itself instead of calling the renderer model, so its first token skips that round trip. Longer requests, and "
    "any with a chat_template of its own, go to the renderer, which bounds each render by render_timeout_s and "
    "runs beside chat. 0: every request goes to the renderer (docs/architecture.md#request-flow).",
)
MAX_REQUEST_BYTES = Setting(
    "max_request_bytes",
    "max_request_bytes",
    "PDCHAT_MAX_REQUEST_BYTES",
    "4194304",
    INTEGER,
    ("chat", "renderer"),
    "Largest `request` (or `text_input`) taken, in bytes; larger ones are refused before they are parsed.",
)

# The renderer: chat templates and Harmony.
ALLOW_UNSUPPORTED_MODEL = Setting(
    "allow_unsupported_model",
    "allow_unsupported_model",
    "PDCHAT_ALLOW_UNSUPPORTED_MODEL",
    "false",
    FLAG,
    ("prefill", "decode", "renderer", "chat"),
    "Serve a model whose family pdchat's engine does not support, or whose config asks for what its attention does "
    "not compute (a logit softcap, latent attention, recurrent layers): by default such a model is refused at load "
    "(docs/models.md). Its outputs may be wrong.",
)
ALLOW_REQUEST_TEMPLATES = Setting(
    "allow_request_templates",
    "allow_request_templates",
    "PDCHAT_ALLOW_REQUEST_TEMPLATES",
    "false",
    FLAG,
    ("chat", "renderer"),
    "Whether chat_template_kwargs may carry a `chat_template`. The template is the server's, as in vLLM without "
    "--trust-request-chat-template: a request's own template bypasses it.",
)
RENDER_TIMEOUT_S = Setting(
    "render_timeout_s",
    "render_timeout_s",
    "PDCHAT_RENDER_TIMEOUT_S",
    "2",
    NUMBER,
    ("chat", "renderer"),
    "Longest one chat template render may run, in seconds.",
)
CURRENT_DATE = Setting(
    "current_date",
    "current_date",
    "PDCHAT_CURRENT_DATE",
    "",
    TEXT,
    ("chat", "renderer"),
    "The conversation date Harmony's (GPT-OSS) system message states; unset: today, in UTC. Set it alike for "
    "renderer and chat (the environment does both): chat fingerprints it.",
)

# KV held by prefill, pulled by decode.
KV_TTL_S = Setting(
    "kv_ttl_s",
    "kv_ttl_s",
    "PDCHAT_KV_TTL_S",
    "60",
    NUMBER,
    ("prefill",),
    "Seconds a prefill server holds KV no decode server has pulled.",
)
KV_BUDGET_MB = Setting(
    "kv_budget_mb",
    "kv_budget_mb",
    "PDCHAT_KV_BUDGET_MB",
    "2048",
    NUMBER,
    ("prefill",),
    "Most KV, in MiB, a prefill server holds for decode servers to pull; past it, prefills are refused as UNAVAILABLE.",
)
KV_PULL_TIMEOUT_S = Setting(
    "kv_pull_timeout_s",
    None,
    "PDCHAT_KV_PULL_TIMEOUT_S",
    "30",
    NUMBER,
    ("decode",),
    "Longest NIXL READ from a prefill server, in seconds; then decode recomputes the prompt from its ids.",
)

# The KV block pool of prefill and decode.
PREFILL_KV_MB = Setting(
    "prefill_kv_mb",
    "prefill_kv_mb",
    "PDCHAT_PREFILL_KV_MB",
    "512",
    NUMBER,
    ("prefill",),
    "prefill's KV pool, in MiB, allocated at load: the prompts being computed and its prefix cache. A prompt "
    "starts once its blocks fit beside those in progress (else it waits, queue_timeout_s); one larger than the "
    "pool is refused as UNAVAILABLE.",
)
KV_BLOCK_TOKENS = Setting(
    "kv_block_tokens",
    "kv_block_tokens",
    "PDCHAT_KV_BLOCK_TOKENS",
    "16",
    INTEGER,
    ("prefill", "decode", "router"),
    "Tokens per KV block: the unit the pool hands out and the prefix cache shares (prefill and decode may differ). "
    "The router reads the prefill servers' KV events in blocks of it (`pdchat router --kv-event-block-size` "
    "overrides).",
)
PREFIX_CACHING = Setting(
    "prefix_caching",
    "prefix_caching",
    "PDCHAT_PREFIX_CACHING",
    "true",
    FLAG,
    ("prefill", "decode"),
    "Keep full KV blocks after their request and reuse them for prompts that start with the same tokens "
    "(and the same cache_salt).",
)

# decode's batch.
MAX_RUNNING = Setting(
    "max_running",
    "max_running",
    "PDCHAT_MAX_RUNNING",
    "32",
    INTEGER,
    ("decode",),
    "Sequences decoding or prefilling at once in one decode batch.",
)
DECODE_KV_MB = Setting(
    "decode_kv_mb",
    "decode_kv_mb",
    "PDCHAT_DECODE_KV_MB",
    "1024",
    NUMBER,
    ("decode",),
    "decode's KV pool, in MiB, allocated at load: the running sequences' blocks and its prefix cache. Each admitted "
    "request reserves blocks for its prompt plus max_tokens; past the pool, requests wait.",
)
DECODE_KV_SHARE = Setting(
    "decode_kv_share",
    "decode_kv_share",
    "PDCHAT_DECODE_KV_SHARE",
    "0.5",
    NUMBER,
    ("decode",),
    "The part of decode's KV pool, and of max_running's sequences, (0 to 1] one caller's requests may hold "
    "together; a caller is the request "
    "parameter kv_owner (pdchat's fronts send one per client request, grouping its n choices, or per tenant with "
    "--tenant-header), else each request is its own. A caller's request past its share waits for the caller's "
    "own requests to finish (queue_timeout_s does not end that wait), while other callers' requests pass it; a "
    "caller holding nothing is always admitted when the pool has room.",
)
QUEUE_TIMEOUT_S = Setting(
    "queue_timeout_s",
    "queue_timeout_s",
    "PDCHAT_QUEUE_TIMEOUT_S",
    "30",
    NUMBER,
    ("prefill", "decode"),
    "Longest a request waits for room, in seconds: in decode's batch, or for prefill's KV blocks (a prompt "
    "starts once its blocks fit beside those of the prompts in progress); then UNAVAILABLE, naming the limit.",
)
PREFILL_PASS_TOKENS = Setting(
    "prefill_pass_tokens",
    "prefill_pass_tokens",
    "PDCHAT_PREFILL_PASS_TOKENS",
    "2048",
    INTEGER,
    ("prefill",),
    "Prompt tokens prefill computes in one pass: a prompt up to this long is computed whole (its first token after "
    "its own work); a longer one in passes of this many. Each pass goes to the prompt in progress with the fewest "
    "passes left, the oldest among equals, so a prompt behind a long one waits for at most one pass of it. One pass "
    "costs less than the same tokens in smaller chunks, which each read the prompt so far back from the pool.",
)
PREFILL_BATCH_TOKENS = Setting(
    "prefill_batch_tokens",
    "prefill_batch_tokens",
    "PDCHAT_PREFILL_BATCH_TOKENS",
    "512",
    COUNT,
    ("prefill",),
    "On pdchat's own forward, a prefill pass takes along the other prompts in progress it completes while its tokens "
    "stay within this many, in one forward pass: a burst of short prompts (a conversation's next turns, "
    "mostly cached) costs one pass, not one each. A pass of more prompts' tokens would hold the first of them "
    "back for the others' work. 0: one prompt per pass (docs/batching.md#prefill).",
)
PREFILL_CHUNK = Setting(
    "prefill_chunk",
    "prefill_chunk",
    "PDCHAT_PREFILL_CHUNK",
    "512",
    INTEGER,
    ("decode",),
    "Prompt tokens per chunk when decode prefills a prompt itself, a chunk between its batch's decode steps (so a "
    "long prompt does not stall the running streams); prefill's passes are prefill_pass_tokens.",
)

# KV events (pdchat.core.kv_events): vLLM's wire format, for cache-aware routers.
_EVENTS_ENDPOINT_DOC = (
    "Publish {role}'s KV block events (vLLM's KV events: msgpack EventBatch on a ZMQ PUB socket) here; unset: "
    "off. Bound when it names *, ::, a loopback address (tcp://127.0.0.1:PORT: this host alone) or ipc, else "
    "connected. Events carry every prompt's token ids: bind * only with kv_events_curve_dir. Model instance i "
    "publishes on the port + i (ipc: the path + _i)."
)
_REPLAY_ENDPOINT_DOC = (
    "{role}'s KV events replay socket (ZMQ ROUTER, bound): answers a starting sequence number with the buffered "
    "messages from it on; unset: no replay. Instance i: the port + i, as the endpoint."
)
PREFILL_KV_EVENTS_ENDPOINT = Setting(
    "prefill_kv_events_endpoint",
    "prefill_kv_events_endpoint",
    "PDCHAT_PREFILL_KV_EVENTS_ENDPOINT",
    "",
    ENDPOINT,
    ("prefill",),
    _EVENTS_ENDPOINT_DOC.format(role="prefill"),
)
PREFILL_KV_EVENTS_REPLAY_ENDPOINT = Setting(
    "prefill_kv_events_replay_endpoint",
    "prefill_kv_events_replay_endpoint",
    "PDCHAT_PREFILL_KV_EVENTS_REPLAY_ENDPOINT",
    "",
    ENDPOINT,
    ("prefill",),
    _REPLAY_ENDPOINT_DOC.format(role="prefill"),
)
DECODE_KV_EVENTS_ENDPOINT = Setting(
    "decode_kv_events_endpoint",
    "decode_kv_events_endpoint",
    "PDCHAT_DECODE_KV_EVENTS_ENDPOINT",
    "",
    ENDPOINT,
    ("decode",),
    _EVENTS_ENDPOINT_DOC.format(role="decode"),
)
DECODE_KV_EVENTS_REPLAY_ENDPOINT = Setting(
    "decode_kv_events_replay_endpoint",
    "decode_kv_events_replay_endpoint",
    "PDCHAT_DECODE_KV_EVENTS_REPLAY_ENDPOINT",
    "",
    ENDPOINT,
    ("decode",),
    _REPLAY_ENDPOINT_DOC.format(role="decode"),
)
KV_EVENTS_TOPIC = Setting(
    "kv_events_topic",
    "kv_events_topic",
    "PDCHAT_KV_EVENTS_TOPIC",
    "kv-events",
    TEXT,
    ("prefill", "decode"),
    "The topic frame of every KV events message (a subscriber to it, or to the empty topic, gets them).",
)
KV_EVENTS_BUFFER_STEPS = Setting(
    "kv_events_buffer_steps",
    "kv_events_buffer_steps",
    "PDCHAT_KV_EVENTS_BUFFER_STEPS",
    "10000",
    INTEGER,
    ("prefill", "decode"),
    "KV events messages kept for the replay socket (vLLM's buffer_steps); older ones are gone.",
)
KV_EVENTS_CURVE_DIR = Setting(
    "kv_events_curve_dir",
    "kv_events_curve_dir",
    "PDCHAT_KV_EVENTS_CURVE_DIR",
    "",
    PATH,
    ("prefill", "decode", "router"),
    "ZMQ CURVE for KV events (encrypted; subscribers authenticated by key): a directory of pyzmq certificates "
    "(zmq.auth.create_certificates). A publisher reads its server.key_secret and takes only subscribers whose "
    "public key is in its authorized/ subdirectory; pdchat's router (--kv-event-source) reads its "
    "client.key_secret and the publishers' server.key. Unset: plain ZMQ.",
)
KV_EVENTS_LAYOUT = Setting(
    "kv_events_layout",
    "kv_events_layout",
    "PDCHAT_KV_EVENTS_LAYOUT",
    "map",
    choice("array", "map"),
    ("prefill", "decode"),
    "How KV events are encoded: map (a map with the tag under type: current vLLM, whose own KVEventBatch reads "
    "nothing else) or array (each event a positional msgpack array, tag first: vLLM before its PR #42892, for "
    "consumers that old). The batch is positional in both.",
)

# Output grammars (response_format, forced tool calls).
GRAMMAR_MAX_BYTES = Setting(
    "grammar_max_bytes",
    None,
    "PDCHAT_GRAMMAR_MAX_BYTES",
    "131072",
    INTEGER,
    ("router", "openai", "chat", "renderer", "prefill", "decode"),
    "Largest output grammar a request may ask for: the JSON schema's (or the forced tools' parameters') bytes. "
    "Checked wherever a request is parsed, from the environment alone, so that every process agrees.",
)
GRAMMAR_MAX_ENUM_VALUES = Setting(
    "grammar_max_enum_values",
    None,
    "PDCHAT_GRAMMAR_MAX_ENUM_VALUES",
    "1024",
    INTEGER,
    ("router", "openai", "chat", "renderer", "prefill", "decode"),
    "Most `enum` values and `const`s in one output grammar, all together; compile time grows faster than their "
    "count. From the environment alone, like grammar_max_bytes.",
)
GRAMMAR_MAX_DEPTH = Setting(
    "grammar_max_depth",
    None,
    "PDCHAT_GRAMMAR_MAX_DEPTH",
    "32",
    INTEGER,
    ("router", "openai", "chat", "renderer", "prefill", "decode"),
    "Deepest nesting of an output grammar's JSON (objects and arrays). From the environment alone, like "
    "grammar_max_bytes.",
)
GRAMMAR_COMPILE_TIMEOUT_S = Setting(
    "grammar_compile_timeout_s",
    "grammar_compile_timeout_s",
    "PDCHAT_GRAMMAR_COMPILE_TIMEOUT_S",
    "10",
    NUMBER,
    ("prefill", "decode"),
    "Longest one output grammar may take to compile, in seconds; past it the compile is abandoned (its worker "
    "process killed) and the request refused as INVALID_ARG.",
)
GRAMMAR_CACHE_MB = Setting(
    "grammar_cache_mb",
    "grammar_cache_mb",
    "PDCHAT_GRAMMAR_CACHE_MB",
    "64",
    NUMBER,
    ("prefill", "decode"),
    "Compiled output grammars a stage model keeps, in MiB; the least recently used go first.",
)
GRAMMAR_WORKER_MB = Setting(
    "grammar_worker_mb",
    "grammar_worker_mb",
    "PDCHAT_GRAMMAR_WORKER_MB",
    "1024",
    NUMBER,
    ("prefill", "decode"),
    "Memory, in MiB, a stage model's grammar-compiling process may keep after a compile; past it the process is "
    "replaced, so a large compile's memory goes back to the system.",
)

# Keys.
HANDOFF_KEY = Setting(
    "handoff_key",
    None,
    "PDCHAT_HANDOFF_KEY",
    "",
    TEXT,
    ("chat", "renderer", "prefill", "decode"),
    "The deployment's shared secret (at least 16 bytes): prefill servers sign handoffs with it, decode servers "
    "verify them.",
)
HANDOFF_KEY_FILE = Setting(
    "handoff_key_file",
    None,
    "PDCHAT_HANDOFF_KEY_FILE",
    "",
    PATH,
    ("chat", "renderer", "prefill", "decode"),
    "A file holding the handoff key, read when PDCHAT_HANDOFF_KEY is unset.",
)
STAGE_KEY = Setting(
    "stage_key",
    None,
    "PDCHAT_STAGE_KEY",
    "",
    TEXT,
    ("chat", "renderer", "prefill", "decode"),
    "Key of the seals on stage inputs (renderer, prefill and decode serve only what this server's renderer, "
    "prefill or chat made); unset: a random key of this tritonserver process's own, in a 0600 file of the cache "
    "directory. Servers given one key take each other's seals.",
)
STAGE_SEAL_TTL_S = Setting(
    "stage_seal_ttl_s",
    None,
    "PDCHAT_STAGE_SEAL_TTL_S",
    "60",
    NUMBER,
    ("chat", "renderer", "prefill", "decode"),
    "Seconds a seal on a stage input stays valid; prefill and decode take each seal once. Keep it above the "
    "longest a rendered prompt waits for one of chat's stage lanes to prefill it.",
)
API_KEY = Setting(
    "api_key",
    None,
    "PDCHAT_API_KEY",
    "",
    TEXT,
    ("router", "openai"),
    "Bearer token the HTTP front requires on all but /health and /metrics (`--api-key` overrides it); unset: no key.",
)
TENANT_HEADER = Setting(
    "tenant_header",
    None,
    "PDCHAT_TENANT_HEADER",
    "",
    TEXT,
    ("router", "openai"),
    "The request header that names each request's tenant, set by an authenticating proxy before the front "
    "(`--tenant-header` overrides it): each tenant's requests get a cache_salt of their own (no cached block, "
    "so no cached_tokens hit, is ever another tenant's) and count against one share of decode's KV "
    "(decode_kv_share); a request without the header gets 400. Unset: every client shares the prefix cache.",
)

# The router's and the per-server fronts' HTTP service.
STALL_TIMEOUT_S = Setting(
    "stall_timeout_s",
    None,
    "PDCHAT_STALL_TIMEOUT_S",
    "60",
    NUMBER,
    ("router", "openai"),
    "Longest the router (and `pdchat openai`) waits for a server's first response, or for its next one, in "
    "seconds; past it the client gets 504 upstream_timeout, the server is told to cancel the request and gets no "
    "new request until it answers a readiness probe. A request's wait for room in decode's batch (decode's "
    "queue_timeout_s) is silence too: keep it above stage_stall_timeout_s, so that a server's own clear error "
    "arrives first.",
)
DRAIN_TIMEOUT_S = Setting(
    "drain_timeout_s",
    None,
    "PDCHAT_DRAIN_TIMEOUT_S",
    "30",
    NUMBER,
    ("router", "openai"),
    "On SIGTERM or POST /drain: how long, in seconds, the requests running may take to finish while new ones get "
    "503 draining; then those left end with an error and their servers are told to cancel them.",
)

SETTINGS: tuple[Setting, ...] = tuple(value for value in dict(globals()).values() if isinstance(value, Setting))
"""Every setting above, in the order the docs list them.
NOTE: a Setting defined below this line would be missing from it."""


def cache_dir() -> Path:
    """Root of generated artefacts (CACHE_DIR): embedded models, the backend directory, logs, kernels."""
    return Path(CACHE_DIR.get())


def forwarded_ids_policy(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> str:
    """The chat model's gate policy (FORWARDED_IDS): off, signed or trusted."""
    return FORWARDED_IDS.get(parameters, environ)


def handoff_ttl_s(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> float:
    """Seconds a signed handoff stays valid (HANDOFF_TTL_S)."""
    return HANDOFF_TTL_S.get(parameters, environ)


def kv_connector(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> str:
    """The connector a prefill server publishes KV through (KV_CONNECTOR), one of registry.KV_CONNECTORS."""
    return KV_CONNECTOR.get(parameters, environ)


def kv_options(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> dict[str, float | int]:
    """A connector's keyword arguments: how long unpulled KV is held (`ttl_s`, KV_TTL_S) and
    how much of it (`budget_bytes`, KV_BUDGET_MB)."""
    budget_mb = KV_BUDGET_MB.get(parameters, environ)
    return {"ttl_s": KV_TTL_S.get(parameters, environ), "budget_bytes": int(budget_mb * MIB)}


def max_request_bytes(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> int:
    """Largest `request` (or `text_input`) chat and the renderer take (MAX_REQUEST_BYTES)."""
    return MAX_REQUEST_BYTES.get(parameters, environ)


@dataclass(frozen=True)
class KVPoolOptions:
    bytes: int = 256 * MIB  # the pool's size, allocated at load
    block_tokens: int = 16  # tokens per block
    prefix_caching: bool = True  # full blocks kept and reused


DEFAULT_KV_POOL = KVPoolOptions()  # what a model made outside a server (tests, benchmarks) gets


def kv_pool_options(role: str, parameters: dict[str, str], environ: os._Environ | dict | None = None) -> KVPoolOptions:
    """A stage's KV pool (`role` prefill or decode): PREFILL_KV_MB or DECODE_KV_MB, KV_BLOCK_TOKENS, PREFIX_CACHING."""
    size = {"prefill": PREFILL_KV_MB, "decode": DECODE_KV_MB}[role]
    return KVPoolOptions(
        bytes=int(size.get(parameters, environ) * MIB),
        block_tokens=KV_BLOCK_TOKENS.get(parameters, environ),
        prefix_caching=PREFIX_CACHING.get(parameters, environ),
    )


@dataclass(frozen=True)
class KVEventsOptions:
    endpoint: str  # PUB: bound if it has *, :: or is ipc/inproc, else connected
    replay_endpoint: str | None  # ROUTER, bound; None: no replay
    topic: str
    buffer_steps: int  # messages kept for replay
    layout: str  # array or map
    curve_dir: str | None = None  # CURVE certificates (KV_EVENTS_CURVE_DIR); None: plain ZMQ


def kv_events_options(
    role: str, parameters: dict[str, str], environ: os._Environ | dict | None = None
) -> KVEventsOptions | None:
    """A stage's KV events (`role` prefill or decode), before any per-instance offset; None: off.
    {ROLE}_KV_EVENTS_ENDPOINT, {ROLE}_KV_EVENTS_REPLAY_ENDPOINT, KV_EVENTS_TOPIC, _BUFFER_STEPS, _LAYOUT, _CURVE_DIR."""
    endpoint, replay = {
        "prefill": (PREFILL_KV_EVENTS_ENDPOINT, PREFILL_KV_EVENTS_REPLAY_ENDPOINT),
        "decode": (DECODE_KV_EVENTS_ENDPOINT, DECODE_KV_EVENTS_REPLAY_ENDPOINT),
    }[role]
    address = endpoint.get(parameters, environ)
    if not address:
        return None
    return KVEventsOptions(
        endpoint=address,
        replay_endpoint=replay.get(parameters, environ) or None,
        topic=KV_EVENTS_TOPIC.get(parameters, environ),
        buffer_steps=KV_EVENTS_BUFFER_STEPS.get(parameters, environ),
        layout=KV_EVENTS_LAYOUT.get(parameters, environ),
        curve_dir=KV_EVENTS_CURVE_DIR.get(parameters, environ) or None,
    )


@dataclass(frozen=True)
class BatchingOptions:
    max_running: int  # sequences in one decode batch
    kv_share: float  # the part of decode's KV pool one caller's requests may reserve together
    queue_timeout_s: float  # longest wait for room, then UNAVAILABLE
    prefill_chunk: int  # prompt tokens per local prefill chunk, between decode steps
    prefill_pass_tokens: int  # prompt tokens per pass in prefill
    prefill_batch_tokens: int  # tokens of a prefill pass that computes several prompts; 0: one per pass
    prefill_takes_cores_ms: int  # a prefill pass expected this long or longer takes the cores in turns; 0: none


def batching_options(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> BatchingOptions:
    """The stages' limits: MAX_RUNNING, DECODE_KV_SHARE, QUEUE_TIMEOUT_S, PREFILL_CHUNK,
    PREFILL_PASS_TOKENS and PREFILL_BATCH_TOKENS (their KV pools: kv_pool_options); ValueError for a
    share outside (0, 1]."""
    share = DECODE_KV_SHARE.get(parameters, environ)
    if not 0 < share <= 1:
        raise ValueError(f"setting {DECODE_KV_SHARE.name} must be in (0, 1], got {share}")
    return BatchingOptions(
        max_running=MAX_RUNNING.get(parameters, environ),
        kv_share=share,
        queue_timeout_s=QUEUE_TIMEOUT_S.get(parameters, environ),
        prefill_chunk=PREFILL_CHUNK.get(parameters, environ),
        prefill_pass_tokens=PREFILL_PASS_TOKENS.get(parameters, environ),
        prefill_batch_tokens=PREFILL_BATCH_TOKENS.get(parameters, environ),
        prefill_takes_cores_ms=PREFILL_TAKES_CORES_MS.get(parameters, environ),
    )


@dataclass(frozen=True)
class GrammarLimits:
    """How large an output grammar a request may ask for, checked before anything is built."""

    max_bytes: int  # the spec's JSON (schema, or the forced tools' parameters)
    max_enum_values: int  # `enum` values and `const`s, over the whole spec
    max_depth: int  # nesting of the spec's JSON objects and arrays


def grammar_limits(environ: Mapping[str, str] | None = None) -> GrammarLimits:
    """GRAMMAR_MAX_BYTES, GRAMMAR_MAX_ENUM_VALUES and GRAMMAR_MAX_DEPTH, from the environment."""
    return GrammarLimits(
        GRAMMAR_MAX_BYTES.get(None, environ),
        GRAMMAR_MAX_ENUM_VALUES.get(None, environ),
        GRAMMAR_MAX_DEPTH.get(None, environ),
    )


@dataclass(frozen=True)
class CompileOptions:
    timeout_s: float  # longest one compile may run; past it the request is refused
    cache_bytes: int  # compiled grammars kept, by their size in memory
    worker_rss_bytes: int  # a worker process grown past this is replaced after its compile


def compile_options(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> CompileOptions:
    """How a stage model compiles output grammars: GRAMMAR_COMPILE_TIMEOUT_S, GRAMMAR_CACHE_MB, GRAMMAR_WORKER_MB."""
    return CompileOptions(
        timeout_s=GRAMMAR_COMPILE_TIMEOUT_S.get(parameters, environ),
        cache_bytes=int(GRAMMAR_CACHE_MB.get(parameters, environ) * MIB),
        worker_rss_bytes=int(GRAMMAR_WORKER_MB.get(parameters, environ) * MIB),
    )


def stage_lanes(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> int:
    """chat's lanes for blocking BLS calls to renderer and prefill (STAGE_LANES)."""
    return STAGE_LANES.get(parameters, environ)


def chat_render_max_chars(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> int:
    """Longest request chat renders itself; 0: none (CHAT_RENDER_MAX_CHARS)."""
    return CHAT_RENDER_MAX_CHARS.get(parameters, environ)


def allow_request_templates(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> bool:
    """Whether chat_template_kwargs may carry a `chat_template` (ALLOW_REQUEST_TEMPLATES)."""
    return ALLOW_REQUEST_TEMPLATES.get(parameters, environ)


def render_timeout_s(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> float:
    """The bound on one chat template render, in seconds (RENDER_TIMEOUT_S)."""
    return RENDER_TIMEOUT_S.get(parameters, environ)


def current_date(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> str | None:
    """Harmony's conversation date (CURRENT_DATE); None: today, in UTC."""
    return CURRENT_DATE.get(parameters, environ) or None


def cpu_placement(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> CpuPlacement | None:
    """DECODE_CPUS resolved among the CPUs this process may run on (None: no binding);
    ModelUnavailable, naming the setting, for CPUs it may not run on."""
    wanted = DECODE_CPUS.get(parameters, environ)
    try:
        return CpuPlacement.resolve(wanted, allowed_cpus(), torch_threads(parameters, environ))
    except ValueError as exc:
        raise ModelUnavailable(f"{DECODE_CPUS.names} {exc}") from None


def check_environment(environ: os._Environ | dict | None = None) -> None:
    """Every setting as this environment gives it (`environ`, else this process's), and the
    CPUs decode_cpus names: ModelUnavailable, naming the first that a model would refuse."""
    for setting in SETTINGS:
        setting.get(None, environ)
    cpu_placement({}, environ)


def keep_off_decode_cpus(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> CpuPlacement | None:
    """Bind every thread of this process to the CPUs DECODE_CPUS leaves to all but decode's
    scheduler thread; the placement (None: nothing bound)."""
    placement = cpu_placement(parameters, environ)
    if placement is not None:
        bind_process(placement.others)
    return placement


def torch_threads(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> int:
    """torch's CPU threads in a stage model (TORCH_THREADS); auto: half the cores this
    process may run on (its affinity, not the host's), at least 1."""
    threads = TORCH_THREADS.get(parameters, environ)
    return max(1, len(os.sched_getaffinity(0)) // 2) if threads is None else threads


def prefill_threads_when_idle(parameters: dict[str, str], environ: os._Environ | dict | None = None) -> int:
    """The most torch threads a prompt's pass in prefill takes (PREFILL_THREADS_WHEN_IDLE);
    auto: every core this process may run on."""
    threads = PREFILL_THREADS_WHEN_IDLE.get(parameters, environ)
    return len(os.sched_getaffinity(0)) if threads is None else threads


# docs/configuration.md: a hand-written intro, then this table between the markers.
BEGIN_MARKER = "<!-- BEGIN generated by python -m pdchat.core.settings --markdown -->"
END_MARKER = "<!-- END generated by python -m pdchat.core.settings --markdown -->"


def markdown() -> str:
    """The Markdown table of every setting, as docs/configuration.md holds it."""

    def code(text: str | None) -> str:
        return "-" if text is None else f"`{text}`"

    rows = [
        "| Setting | config.pbtxt parameter | Environment variable | Default | Values | Applies to | Description |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        default = code(setting.default) if setting.default else "unset"
        cells = [
            setting.name,
            code(setting.param),
            code(setting.env),
            default,
            setting.type.spelling,
            ", ".join(setting.applies_to),
            setting.doc,
        ]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def with_table(document: str) -> str:
    """`document` with the block between the markers replaced by the current table."""
    head, begin, rest = document.partition(BEGIN_MARKER + "\n")
    _, end, tail = rest.partition(END_MARKER)
    if not begin or not end:
        raise ValueError(f"no {BEGIN_MARKER} ... {END_MARKER} block")
    return head + begin + markdown() + end + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdchat.core.settings", description="pdchat's settings table")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--markdown", action="store_true", help="print the Markdown table of every setting")
    action.add_argument("--check", type=Path, metavar="DOC", help="exit 1 if DOC's generated table is out of date")
    action.add_argument("--write", type=Path, metavar="DOC", help="regenerate DOC's table in place")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    path = args.check or args.write
    current = path.read_text()
    try:
        wanted = with_table(current)
    except ValueError as exc:
        parser.error(f"{path}: {exc}")
    if args.write:
        path.write_text(wanted)
    elif current != wanted:
        print(
            f"{path}: the settings table is out of date; run python -m pdchat.core.settings --write {path}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
