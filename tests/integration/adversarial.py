"""Forwarded ids a hostile client might send, and the gate's reason for refusing each: shared
by the reuse tests of every render format (a handoff `h` from a real prefill leg in)."""

from __future__ import annotations


def tampered(handed, **changes):
    return {**handed.kv_transfer_params, **changes}


ADVERSARIAL = {
    "unsigned": (lambda h: {"prompt_token_ids": h.prompt_token_ids}, "unsigned"),
    "forged_signature": (
        lambda h: {"prompt_token_ids": h.prompt_token_ids, "kv_transfer_params": tampered(h, signature="ab" * 32)},
        "bad_signature",
    ),
    "ids_altered": (
        lambda h: {"prompt_token_ids": h.prompt_token_ids[:-1] + [42], "kv_transfer_params": h.kv_transfer_params},
        "bad_signature",
    ),
    "expiry_extended": (
        lambda h: {
            "prompt_token_ids": h.prompt_token_ids,
            "kv_transfer_params": tampered(h, expires_at=h.kv_transfer_params["expires_at"] + 3600),
        },
        "bad_signature",
    ),
    "peer_injected": (
        lambda h: {
            "prompt_token_ids": h.prompt_token_ids,
            "kv_transfer_params": tampered(
                h,
                kv_handle={
                    **h.kv_transfer_params["kv_handle"],
                    "connector": "nixl",
                    "location": {"agent": "evil", "metadata": "", "id": "1", "addr": 4096},
                },
            ),
        },
        "bad_signature",
    ),
    "handle_malformed": (
        lambda h: {
            "prompt_token_ids": h.prompt_token_ids,
            "kv_transfer_params": tampered(h, kv_handle={"host": "203.0.113.7", "port": 1}),
        },
        "malformed",
    ),
    "non_ascii_signature": (
        lambda h: {"prompt_token_ids": h.prompt_token_ids, "kv_transfer_params": tampered(h, signature="é" * 64)},
        "bad_signature",
    ),
    "out_of_vocabulary": (lambda h: {"prompt_token_ids": [1, 2, 10**6]}, "out_of_vocabulary"),
    "negative_ids": (lambda h: {"prompt_token_ids": [1, -5, 3]}, "out_of_vocabulary"),
    "empty_list": (lambda h: {"prompt_token_ids": []}, "empty"),
    "longer_than_context": (lambda h: {"prompt_token_ids": [7] * 16384}, "too_long"),
    "malformed_params": (
        lambda h: {"prompt_token_ids": h.prompt_token_ids, "kv_transfer_params": "{broken"},
        "malformed",
    ),
    "ids_twice": (
        lambda h: {
            "prompt_token_ids": h.prompt_token_ids,
            "kv_transfer_params": tampered(h, prompt_token_ids=h.prompt_token_ids),
        },
        "malformed",
    ),
}
