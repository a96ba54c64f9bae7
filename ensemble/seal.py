"""Seals on stage inputs: `renderer`, `prefill` and `decode` serve only what this
deployment's renderer or gate produced.

Triton serves every model of a repository to clients, stage models included. Without a
seal, a direct call to `decode` would take token ids that never met the chat template
(the very bypass the gate exists to stop), unchecked generation parameters, or any KV
handle. The renderer seals the ids and generation params it makes; `chat` seals what it
sends after the gate admitted forwarded ids (with their KV handle); each stage refuses
input without a valid seal. An HMAC-SHA256 over the exact bytes, with a key that never
leaves the server's processes.

Key: $PDCHAT_STAGE_KEY; else derived from the handoff key; else a random key kept in a
0600 file of the cache directory, shared by the models of every server of this user.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.settings import STAGE_KEY, cache_dir
from pdchat.ensemble.handoff import ids_digest, load_key, mac, same_mac

KEY_FILE_NAME = "stage.key"


class Unsealed(InvalidRequest):
    """A stage model's input does not carry this server's seal."""

    def __init__(self, what: str):
        super().__init__(
            f"{what}: stage models take only input sealed by this server's renderer or chat model; "
            "send chat requests to 'chat' (or 'chat_ensemble')"
        )


class StageSeal:
    def __init__(self, key: bytes):
        self._key = key

    @classmethod
    def for_this_server(cls, environ: dict[str, str] | os._Environ | None = None) -> StageSeal:
        if key := STAGE_KEY.get(environ=environ):
            return cls(key.encode())
        handoff_key = load_key(environ)
        if handoff_key is not None:
            return cls(hmac.new(handoff_key, b"pdchat stage seal v1", hashlib.sha256).digest())
        return cls(_key_file(cache_dir() / KEY_FILE_NAME))

    def seal_request(self, canonical_request: str) -> str:
        """For the renderer: a ChatRequest that `chat` parsed and validated already."""
        return mac(self._key, b"request\0" + canonical_request.encode())

    def check_request(self, canonical_request: str, seal: str | None) -> None:
        self._check(seal, self.seal_request(canonical_request), "an unsealed chat_request")

    def seal_prompt(self, prompt_token_ids: list[int], generation_params: str, kv_handle: str = "") -> str:
        """For prefill and decode: ids and generation params from the renderer (or admitted
        by the gate), and the KV handle the gate verified."""
        return mac(
            self._key,
            b"\0".join(
                [b"prompt", ids_digest(prompt_token_ids).encode(), generation_params.encode(), kv_handle.encode()]
            ),
        )

    def check_prompt(
        self, prompt_token_ids: list[int], generation_params: str, kv_handle: str, seal: str | None
    ) -> None:
        self._check(
            seal,
            self.seal_prompt(prompt_token_ids, generation_params, kv_handle),
            "unsealed prompt ids, generation params or KV handle",
        )

    def seal_cancel(self, request_id: str) -> str:
        return mac(self._key, b"cancel\0" + request_id.encode())

    def check_cancel(self, request_id: str, seal: str | None) -> None:
        self._check(seal, self.seal_cancel(request_id), "an unsealed cancellation")

    @staticmethod
    def _check(seal: str | None, expected: str, what: str) -> None:
        if seal is None or not same_mac(seal, expected):
            raise Unsealed(what)


def _key_file(path: Path) -> bytes:
    """This user's stage key, made once (0600, atomically) by whichever process comes first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        key = secrets.token_hex(32).encode()
        with os.fdopen(fd, "wb") as out:
            out.write(key)
        return key
    for _ in range(100):  # the creator may not have written it yet
        info = path.lstat()
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ModelUnavailable(f"the stage key file {path} must be owned by this user with mode 0600")
        key = path.read_bytes()
        if len(key) == 64:
            return key
        time.sleep(0.01)
    raise ModelUnavailable(f"the stage key file {path} is not a key (64 hex characters); remove it")
