"""Every tensor and config-parameter name of the model repository, in one place.

The config.pbtxt files spell these names too (Triton reads them there); a unit test
checks that each config and this module agree.
"""

# Client contract, inputs (chat_ensemble, and chat later).
REQUEST = "request"
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

# Between stages: renderer -> prefill -> decode.
GENERATION_PARAMS = "generation_params"  # JSON of core.protocol.GenerationParams
KV_CACHE = "kv_cache"  # FP32 [layers, 2, kv_heads, tokens, head_dim]
FIRST_TOKEN_ID = "first_token_id"  # INT32 [1], sampled by prefill
# prefill: publish the KV through this connector (shm, nixl) and answer KV_HANDLE instead of KV_CACHE.
KV_DESTINATION = "kv_destination"
KV_HANDLE = "kv_handle"  # JSON handle of published KV; decode pulls it
# decode control input: stop the request whose GenerationParams.request_id this names
# (Triton 2.51 passes no cancellation from a BLS caller or an ensemble to decode).
CANCEL_REQUEST_ID = "cancel_request_id"

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

# Model config parameters (config.pbtxt `parameters`), read by pdchat.core.settings.
PARAM_MODEL = "model"  # embedded model name or HF model directory
PARAM_DEVICE = "device"  # "auto" (CUDA when present), "cpu" or "cuda"
PARAM_FORWARDED_IDS = "forwarded_ids"  # chat: off | signed | trusted
PARAM_HANDOFF_TTL_S = "handoff_ttl_s"  # chat: seconds a signed handoff stays valid
PARAM_KV_CONNECTOR = "kv_connector"  # chat (prefill role): shm | nixl
PARAM_KV_TTL_S = "kv_ttl_s"  # prefill: seconds unpulled KV is held
PARAM_KV_BUDGET_MB = "kv_budget_mb"  # prefill: most KV held at once
PARAM_MAX_RUNNING = "max_running"  # decode: sequences batched at once
PARAM_DECODE_KV_MB = "decode_kv_mb"  # decode: KV its running sequences may reserve
PARAM_QUEUE_TIMEOUT_S = "queue_timeout_s"  # decode: longest wait for room before UNAVAILABLE
PARAM_PREFILL_CHUNK = "prefill_chunk"  # decode: prompt tokens per local prefill chunk
