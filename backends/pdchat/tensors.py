"""Every tensor name of the model repository, and chat's whole contract, in one place.

`chat` declares its inputs and outputs from CHAT_INPUTS / CHAT_OUTPUTS (auto-complete),
so its three configs (one per role) hold only what differs. The other config.pbtxt files
spell the names too (Triton reads them there); a unit test checks they agree with this module.
"""

from __future__ import annotations

from typing import NamedTuple

# The stage models' names, as chat calls them (and a ticket's caller calls decode).
RENDERER, PREFILL, DECODE = "renderer", "prefill", "decode"

# Client contract, inputs (chat_ensemble, and chat later).
REQUEST = "request"
# chat only: an OpenAI completions body (a raw prompt, text or token ids; no chat template).
COMPLETION_REQUEST = "completion_request"
TEXT_INPUT = "text_input"
MAX_TOKENS = "max_tokens"
STREAM = "stream"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
TEMPERATURE = "temperature"
TOP_P = "top_p"
SEED = "seed"

# Forwarded ids (chat only): PROMPT_TOKEN_IDS as an input, and vLLM-style JSON params.
KV_TRANSFER_PARAMS = "kv_transfer_params"

# Client contract, outputs.
TEXT_OUTPUT = "text_output"
RESPONSE = "response"
PROMPT_TOKEN_IDS = "prompt_token_ids"
OUTPUT_TOKEN_IDS = "output_token_ids"
FINISH_REASON = "finish_reason"

# Request parameter (not a tensor) of chat and decode: a caller waiting for a whole answer with a
# deadline between responses asks for an empty response after this many milliseconds (an int:
# Triton's parameters are bool, int or string) without one. decode sends them; chat asks decode
# for them and forwards them to a client that asked too.
HEARTBEAT_MS = "heartbeat_ms"
# Request parameter of chat (a bool): where chat would relay decode's stream, it answers once with
# decode's sealed inputs instead (DECODE_TICKET_OUTPUTS, a ticket), and the caller streams the answer
# from `decode` on the same server itself, sending it those outputs as inputs (the OpenAI fronts
# do). A ticket opens decode once, within stage_seal_ttl_s.
DECODE_TICKET = "decode_ticket"
# decode's feed: a caller streaming many answers from decode at once (the OpenAI fronts) opens
# one request whose parameter DECODE_FEED_OPEN names the feed (a random string) and whose
# STAGE_SEAL is a feed grant: chat answers a ticket request whose parameter DECODE_FEED_GRANT
# names a feed with FEED_SEAL, a seal that opens decode's feed of that name once.
# The feed request carries nothing else and ends when its caller cancels it (or decode gives its
# place to a new feed while no stream names it: pdchat.core.output.feeds.DecodeFeeds).
# Each ticket request that names the feed (parameters DECODE_FEED, and DECODE_FEED_KEY, its own
# key there) gets its outputs but the last through it: one response per decode step for all its
# streams, FEED_KEYS [n] and FEED_RESPONSES [n] (each output's RESPONSE JSON, nothing else); its
# last output comes on its own stream with FED_OUTPUTS, how many went through the feed (requested
# by the caller). A stream whose feed decode does not hold at its first output is not fed.
DECODE_FEED_OPEN = "decode_feed_open"
DECODE_FEED_GRANT = "decode_feed_grant"
FEED_SEAL = "feed_seal"
DECODE_FEED = "decode_feed"
DECODE_FEED_KEY = "decode_feed_key"
FEED_KEYS = "feed_keys"
FEED_RESPONSES = "feed_responses"
FED_OUTPUTS = "fed_outputs"
# Request parameter of chat and decode (a string of 1 to 128 characters): the caller a request's
# reservation of decode's KV counts against (setting decode_kv_share); chat passes it on to
# decode. pdchat's fronts send one per client request (its n choices share it), or per tenant.
KV_OWNER = "kv_owner"
# A streamed answer's first output goes to the client once prefill chose its token, not once
# decode sent it (core.generation.generation.TextModel.first_output); decode then skips it.
# Request parameters of chat (bools): FIRST_OUTPUT_EARLY on a prefill leg (do_remote_decode)
# asks for that output as a response before the answer; FIRST_OUTPUT_SENT on a decode leg says
# the caller has it. Between stages: prefill's FIRST_OUTPUT (JSON of
# core.output.responses.ClientOutput, "" when decode's first output could differ), and
# decode's optional FIRST_OUTPUT_SENT input (a ticket carries it).
FIRST_OUTPUT_EARLY = "first_output_early"
FIRST_OUTPUT_SENT = "first_output_sent"
FIRST_OUTPUT = "first_output"

# Between stages: renderer -> prefill -> decode.
GENERATION_PARAMS = "generation_params"  # JSON of core.request.protocol.GenerationParams
FIRST_TOKEN_ID = "first_token_id"  # INT32 [1], sampled by prefill (also inside KV_HANDLE)
# prefill: publish the KV through this connector (shm, the default; nixl) and answer its KV_HANDLE.
KV_DESTINATION = "kv_destination"
KV_HANDLE = "kv_handle"  # JSON of core.kv.base.KVHandle: where the KV is, the first token; decode pulls it
# decode control input: stop the request whose GenerationParams.request_id this names
# (Triton 2.51 passes no cancellation from a BLS caller or an ensemble to decode).
CANCEL_REQUEST_ID = "cancel_request_id"
# renderer input from chat: the ChatRequest chat parsed already (canonical JSON), not re-parsed.
CHAT_REQUEST = "chat_request"
# Seal on stage inputs (ensemble.seal): made by the renderer, prefill or chat, checked by each stage.
STAGE_SEAL = "stage_seal"
# renderer inputs of the router's /tokenize and /detokenize: vLLM's body JSON; the answer is
# RESPONSE, vLLM's answer JSON (core.request.tokenize).
TOKENIZE_REQUEST = "tokenize_request"
DETOKENIZE_REQUEST = "detokenize_request"

# Optional scalar inputs of the text_input convention: name -> numpy dtype name.
SCALAR_INPUTS = {
    MAX_TOKENS: "int32",
    STREAM: "bool",
    EXCLUDE_INPUT_IN_OUTPUT: "bool",
    TEMPERATURE: "float32",
    TOP_P: "float32",
    SEED: "uint64",
}

CLIENT_INPUTS = (REQUEST, TEXT_INPUT, *SCALAR_INPUTS)
CLIENT_OUTPUTS = (TEXT_OUTPUT, RESPONSE, PROMPT_TOKEN_IDS, OUTPUT_TOKEN_IDS, FINISH_REASON)
# What the router and the OpenAI fronts read of chat's outputs (the JSON carries the text and ids),
# (the router's prefill legs add the prompt ids it forwards to the decode leg).
FRONT_OUTPUTS = (RESPONSE, FINISH_REASON, KV_TRANSFER_PARAMS)
# A ticket (DECODE_TICKET): the sealed inputs of decode, as chat's outputs of the same names.
DECODE_TICKET_OUTPUTS = (PROMPT_TOKEN_IDS, GENERATION_PARAMS, KV_HANDLE, STAGE_SEAL, FIRST_OUTPUT_SENT)
# decode's outputs beside the client contract's: its feed's (DECODE_FEED_OPEN).
DECODE_FEED_OUTPUTS = (FEED_KEYS, FEED_RESPONSES, FED_OUTPUTS)


class TensorSpec(NamedTuple):
    name: str
    data_type: str  # config.pbtxt spelling
    dims: tuple[int, ...] = (1,)
    optional: bool = False


_SCALAR_TYPES = {"int32": "TYPE_INT32", "bool": "TYPE_BOOL", "float32": "TYPE_FP32", "uint64": "TYPE_UINT64"}

# chat: chat_ensemble's client contract plus completions bodies, forwarded ids and the handoff.
CHAT_INPUTS = (
    TensorSpec(REQUEST, "TYPE_STRING", optional=True),
    TensorSpec(TEXT_INPUT, "TYPE_STRING", optional=True),
    *(TensorSpec(name, _SCALAR_TYPES[dtype], optional=True) for name, dtype in SCALAR_INPUTS.items()),
    TensorSpec(COMPLETION_REQUEST, "TYPE_STRING", optional=True),
    TensorSpec(PROMPT_TOKEN_IDS, "TYPE_INT32", (-1,), optional=True),
    TensorSpec(KV_TRANSFER_PARAMS, "TYPE_STRING", optional=True),
)
CHAT_OUTPUTS = (
    TensorSpec(TEXT_OUTPUT, "TYPE_STRING"),
    TensorSpec(RESPONSE, "TYPE_STRING"),
    TensorSpec(PROMPT_TOKEN_IDS, "TYPE_INT32", (-1,)),
    TensorSpec(OUTPUT_TOKEN_IDS, "TYPE_INT32", (-1,)),
    TensorSpec(FINISH_REASON, "TYPE_STRING"),
    TensorSpec(KV_TRANSFER_PARAMS, "TYPE_STRING"),
    # A ticket's (DECODE_TICKET_OUTPUTS, with PROMPT_TOKEN_IDS above).
    TensorSpec(GENERATION_PARAMS, "TYPE_STRING"),
    TensorSpec(KV_HANDLE, "TYPE_STRING"),
    TensorSpec(STAGE_SEAL, "TYPE_STRING"),
    TensorSpec(FIRST_OUTPUT_SENT, "TYPE_BOOL"),
    # A ticket's feed grant (DECODE_FEED_GRANT).
    TensorSpec(FEED_SEAL, "TYPE_STRING"),
)
