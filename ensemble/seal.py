"""Seals on stage inputs: `renderer`, `prefill` and `decode` serve only what this server's
renderer, prefill or `chat` produced, once, for a short while.

Triton serves every model of a repository to clients, stage models included. Without a
seal, a direct call to `decode` would take token ids that never met the chat template
(the very bypass the gate exists to stop), unchecked generation parameters, or any KV
handle. The renderer seals the ids and generation params it makes; `chat` seals what it
sends after the gate admitted forwarded ids (with their KV handle), and the decode feed it
grants with a ticket; prefill seals its KV handle for decode; each stage refuses input
without a valid seal (`Unsealed`, naming why).

A seal is `<key id>.<expires ms>.<nonce>.<mac>`: an HMAC-SHA256 with this server's stage
key over the exact bytes it seals, its kind, its expiry (setting stage_seal_ttl_s) and a
random nonce. prefill and decode, which allocate KV (or hold a feed) for what they take,
take a seal's nonce once (`NonceLedger`): a sealed input seen once cannot be sent again to hold KV.

Key: $PDCHAT_STAGE_KEY; else this server's own, never derived from the deployment's
handoff key, so one server's seals open no other. It is a random key in a 0600 file of
`<cache dir>/stage/<server id>/` (0700), named after the tritonserver process the stage
models run under (their parent: its pid and start time), so a restarted server gets a new
key; the first model that needs it makes it, the others read it.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import secrets
import shutil
import stat
import time
from pathlib import Path

from pdchat.core import procfs
from pdchat.core.errors import InvalidRequest, ModelUnavailable
from pdchat.core.settings import STAGE_KEY, STAGE_SEAL_TTL_S, cache_dir
from pdchat.ensemble.handoff import ids_digest, mac, same_mac

STAGE_DIR_NAME = "stage"
KEY_FILE_NAME = "key"
NONCE_DIR_NAME = "nonces"
KEY_ID_CHARS = 12
NONCE_BYTES = 16
SWEEP_INTERVAL_S = 1.0
_SEAL = re.compile(rf"([0-9a-f]{{{KEY_ID_CHARS}}})\.([0-9]{{1,16}})\.([0-9a-f]{{{2 * NONCE_BYTES}}})\.([0-9a-f]{{64}})")
_KEY = re.compile(rb"[0-9a-f]{64}")
_PRIVATE_DIR_MODE = 0o700


class SealRefusal(str, enum.Enum):
    """Why a stage refused its input's seal."""

    UNSEALED = "unsealed"
    MALFORMED = "malformed"
    NOT_THIS_SERVER = "not this server's"
    ALTERED = "altered"  # the MAC does not match: forged, or the input is not what was sealed
    EXPIRED = "expired"
    REPLAYED = "replayed"


class Unsealed(InvalidRequest):
    """A stage model's input does not carry a valid seal of this server."""

    def __init__(self, what: str, reason: SealRefusal, detail: str):
        super().__init__(
            f"{what} refused ({reason.value}: {detail}): stage models take only input sealed by this server's "
            "renderer or chat model; send chat requests to 'chat' (or 'chat_ensemble')"
        )
        self.reason = reason


class NonceLedger:
    """Nonces of single-use seals, claimed once across every process of one server: an empty
    file each, `<directory>/<expiry second>/<nonce>`, created exclusively.

    NOTE: a bucket whose second has passed holds only expired seals' nonces, refused as
    expired before any claim; whichever process sweeps first removes it (each process at
    most once per SWEEP_INTERVAL_S), so the ledger holds the nonces of live seals only."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._swept_at = float("-inf")

    def claim(self, nonce: str, expires_ms: int, now: float) -> bool:
        """True the first time `nonce` (a seal's, hex) is claimed on this server, False after."""
        self._sweep(now)
        bucket = self.directory / str(expires_ms // 1000)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            fd = os.open(bucket / nonce, flags, 0o600)
        except FileExistsError:
            return False
        except FileNotFoundError:  # the bucket's first nonce
            bucket.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(bucket / nonce, flags, 0o600)
            except FileExistsError:
                return False
        os.close(fd)
        return True

    def _sweep(self, now: float) -> None:
        if now - self._swept_at < SWEEP_INTERVAL_S:
            return
        self._swept_at = now
        try:
            buckets = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in buckets:
            if name.isdigit() and int(name) + 1 <= now:
                shutil.rmtree(self.directory / name, ignore_errors=True)


class StageSeal:
    """Seals and checks stage inputs with one server's key; `nonces`: that server's ledger."""

    def __init__(self, key: bytes, nonces: Path, ttl_s: float = STAGE_SEAL_TTL_S.default_value):
        self._key = key
        self.key_id = mac(key, b"pdchat stage key id")[:KEY_ID_CHARS]
        self.ttl_s = ttl_s
        self._nonces = NonceLedger(nonces)

    @classmethod
    def for_this_server(cls, environ: dict[str, str] | os._Environ | None = None) -> StageSeal:
        """The seal of the tritonserver this process runs under (its parent), as every model
        of that server has it."""
        directory = server_directory(os.getppid())
        explicit = STAGE_KEY.get(environ=environ)
        key = explicit.encode() if explicit else _server_key(directory)
        return cls(key, directory / NONCE_DIR_NAME, STAGE_SEAL_TTL_S.get(environ=environ))

    @classmethod
    def of_server(cls, pid: int) -> StageSeal:
        """The seal of the running tritonserver `pid`, from its key file: for a tool of the
        same user on its host (the benchmarks call stage models directly)."""
        path = server_directory(pid, create=False) / KEY_FILE_NAME
        try:
            key = _read_key(path)
        except FileNotFoundError:
            raise ModelUnavailable(
                f"tritonserver {pid} has no stage key at {path}: its models are not loaded, or {STAGE_KEY.env} is set"
            ) from None
        return cls(key, path.parent / NONCE_DIR_NAME)

    def seal_request(self, canonical_request: str) -> str:
        """For the renderer: a ChatRequest that `chat` parsed and validated already."""
        return self._seal(b"request\0" + canonical_request.encode())

    def check_request(self, canonical_request: str, seal: str | None) -> None:
        self._check(seal, b"request\0" + canonical_request.encode(), "a chat_request")

    def seal_prompt(self, prompt_token_ids: list[int], generation_params: str, kv_handle: str = "") -> str:
        """For prefill and decode: ids and generation params from the renderer (or admitted
        by the gate), and the KV handle prefill made or the gate verified."""
        return self._seal(_prompt_bytes(prompt_token_ids, generation_params, kv_handle))

    def check_prompt(
        self, prompt_token_ids: list[int], generation_params: str, kv_handle: str, seal: str | None
    ) -> None:
        """prefill's and decode's check: the seal opens the stage once (its nonce is claimed)."""
        self._check(
            seal,
            _prompt_bytes(prompt_token_ids, generation_params, kv_handle),
            "prompt ids, generation params or KV handle",
            once=True,
        )

    def seal_feed(self, feed: str) -> str:
        """For chat, with a ticket (tensors.DECODE_FEED_GRANT): a grant that opens decode's
        feed named `feed` once."""
        return self._seal(b"feed\0" + feed.encode())

    def check_feed(self, feed: str, seal: str | None) -> None:
        """decode's check of a feed it is asked to open: the grant opens it once."""
        self._check(seal, b"feed\0" + feed.encode(), "a decode feed", once=True)

    def seal_cancel(self, request_id: str) -> str:
        return self._seal(b"cancel\0" + request_id.encode())

    def check_cancel(self, request_id: str, seal: str | None) -> None:
        self._check(seal, b"cancel\0" + request_id.encode(), "a cancellation")

    def _seal(self, payload: bytes) -> str:
        head = f"{self.key_id}.{int((time.time() + self.ttl_s) * 1000)}.{secrets.token_hex(NONCE_BYTES)}"
        return f"{head}.{self._mac(head, payload)}"

    def _mac(self, head: str, payload: bytes) -> str:
        """The MAC of a seal whose head (key id, expiry, nonce) is `head`, over `payload`."""
        return mac(self._key, head.encode() + b"\0" + payload)

    def _check(self, seal: str | None, payload: bytes, what: str, *, once: bool = False) -> None:
        """One HMAC; then the expiry, and for `once` the nonce's claim."""
        if seal is None:
            raise Unsealed(what, SealRefusal.UNSEALED, "no stage_seal given")
        match = _SEAL.fullmatch(seal)
        if match is None:
            raise Unsealed(what, SealRefusal.MALFORMED, "the stage_seal is not a seal of this version")
        key_id, expires, nonce, given = match.groups()
        if key_id != self.key_id:
            raise Unsealed(what, SealRefusal.NOT_THIS_SERVER, "sealed by another server, or before this one restarted")
        head = seal[: match.start(4) - 1]
        if not same_mac(given, self._mac(head, payload)):
            raise Unsealed(what, SealRefusal.ALTERED, "the seal does not match this input")
        now = time.time()
        expires_ms = int(expires)
        if now * 1000 > expires_ms:
            raise Unsealed(
                what,
                SealRefusal.EXPIRED,
                f"the seal expired {now - expires_ms / 1000:.1f} s ago (setting {STAGE_SEAL_TTL_S.name})",
            )
        if once and not self._nonces.claim(nonce, expires_ms, now):
            raise Unsealed(what, SealRefusal.REPLAYED, "this seal opened a stage already; a seal opens one call")


def _prompt_bytes(prompt_token_ids: list[int], generation_params: str, kv_handle: str) -> bytes:
    return b"\0".join(
        [b"prompt", ids_digest(prompt_token_ids).encode(), generation_params.encode(), kv_handle.encode()]
    )


def server_id(pid: int) -> str:
    """Names the process `pid` for as long as it runs: `<scope>-<pid>-<start time>`."""
    fields = procfs.stat_fields(pid)
    if fields is None or len(fields) < 20:
        raise ModelUnavailable(f"cannot tell which server process {pid} is from /proc/{pid}/stat")
    return f"{_scope()}-{pid}-{fields[19]}"  # field 22 of proc(5), starttime


def server_directory(pid: int, *, create: bool = True) -> Path:
    """Where the stage key and the nonces of tritonserver `pid` live (0700, this user's)."""
    directory = cache_dir() / STAGE_DIR_NAME / server_id(pid)
    if create:
        for path in (directory.parent, directory):
            path.mkdir(mode=_PRIVATE_DIR_MODE, parents=True, exist_ok=True)
            _check_private(path, is_dir=True)
    return directory


def _scope() -> str:
    """What tells this boot and pid namespace from others that share the cache directory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError as exc:
        raise ModelUnavailable(f"cannot tell this host's boot and pid namespace from /proc: {exc}") from None
    return hashlib.sha256(f"{boot}:{namespace}".encode()).hexdigest()[:8]


def _check_private(path: Path, *, is_dir: bool) -> None:
    info = path.lstat()
    kind_ok = stat.S_ISDIR(info.st_mode) if is_dir else stat.S_ISREG(info.st_mode)
    if not kind_ok or info.st_uid != os.getuid() or info.st_mode & 0o077:
        wanted = "a directory of this user's with mode 0700" if is_dir else "a file of this user's with mode 0600"
        raise ModelUnavailable(f"{path}, where the stage key lives, must be {wanted}")


def _read_key(path: Path) -> bytes:
    _check_private(path, is_dir=False)
    key = path.read_bytes()
    if not _KEY.fullmatch(key):
        raise ModelUnavailable(f"the stage key file {path} is not a key (64 hex characters); remove it")
    return key


def _server_key(directory: Path) -> bytes:
    """This server's stage key, made once by whichever of its models comes first: written
    aside, then linked into place, so no model reads it half-written. The maker also removes
    the directories of this scope's servers that no longer run."""
    path = directory / KEY_FILE_NAME
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    staged = directory / f".{KEY_FILE_NAME}.{os.getpid()}"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(secrets.token_hex(32).encode())
    try:
        os.link(staged, path)
    except FileExistsError:
        pass
    else:
        _remove_gone_servers(directory.parent)
    finally:
        staged.unlink()
    return _read_key(path)


def live_server_directories(root: Path) -> dict[Path, int]:
    """This scope's server directories under `root` (server_directory's parent) whose process
    still runs, each with its tritonserver's pid."""
    return {entry: pid for entry, pid in _scope_directories(root, _scope()) if _runs(entry, pid)}


def _runs(entry: Path, pid: int) -> bool:
    try:
        return procfs.alive(pid) and server_id(pid) == entry.name  # a zombie is gone
    except ModelUnavailable:
        return False


def _scope_directories(root: Path, scope: str) -> list[tuple[Path, int]]:
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        parts = entry.name.split("-")
        if len(parts) == 3 and parts[0] == scope and parts[1].isdigit():
            found.append((entry, int(parts[1])))
    return found


def _remove_gone_servers(root: Path) -> None:
    """Remove the directories of this scope's servers whose process is gone (or is another now).

    NOTE: each directory is judged when it is listed, never against an earlier list of live
    ones: a server that starts meanwhile makes its directory after that list, and would lose
    its key to this sweep."""
    for entry, pid in _scope_directories(root, _scope()):
        if not _runs(entry, pid):
            shutil.rmtree(entry, ignore_errors=True)
