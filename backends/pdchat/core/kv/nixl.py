"""KV over NIXL (UCX): the transfer engine of vLLM, Dynamo and TensorRT-LLM.

Prefill registers each KV with its NIXL agent and hands out a handle carrying the
agent's partial metadata for that buffer (under 1 KB: signed with the rest, so decode
never takes a peer address from a client). Decode READs the KV into its own registered buffer
and notifies the prefill agent, which then deregisters and frees it; KV whose request
ended before its pull is discarded by the same notification without the READ, and KV
nobody pulled or discarded is freed when its TTL passes. DRAM to DRAM here; GPU memory works the same way.
"""

from __future__ import annotations

import base64
import os
import threading
import time
import uuid
from typing import Any

import numpy as np

from pdchat.core.kv.base import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_KV_TTL_S,
    KV_TOKEN_AXIS,
    KVBudgetExceeded,
    KVHandle,
    KVUnavailable,
    kv_dtype_name,
    tokens_from,
)
from pdchat.core.settings import KV_BUDGET_MB, KV_PULL_TIMEOUT_S
from pdchat.registry import NIXL

# A READ from a peer that cannot be reached gives up after this; decode then recomputes.
PULL_TIMEOUT_S = KV_PULL_TIMEOUT_S.get()
# A READ's state is asked again after these waits, doubling from the first to the longest.
FIRST_WAIT_S, LONGEST_WAIT_S = 0.0002, 0.005
# UCX's own progress thread busy-spins a core; polling notifications drives the
# worker too, so a light loop serves peers' READs at a fraction of the CPU.
PROGRESS_INTERVAL_S = 0.002
# TCP SYN retransmits before a connection to a peer is given up (UCX's default is the
# kernel's, 6: about 2 minutes, during which decode's pull blocks its scheduler); 2 gives
# up after about 7 s, and decode recomputes. Set UCX_TCP_SYN_CNT to choose otherwise.
UCX_TCP_SYN_CNT = "2"


class NixlConnector:
    name = NIXL
    pull_waits = True

    def __init__(
        self, *, budget_bytes: int = DEFAULT_BUDGET_BYTES, ttl_s: float = DEFAULT_KV_TTL_S, engine_id: str | None = None
    ):
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise KVUnavailable("the nixl connector needs NIXL: pip install --no-deps nixl-cu12") from exc
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self.agent_name = f"pdchat-{engine_id or uuid.uuid4().hex[:12]}"
        os.environ.setdefault("UCX_TCP_SYN_CNT", UCX_TCP_SYN_CNT)  # read by UCX when the agent starts
        self._agent = nixl_agent(
            self.agent_name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False)
        )
        self._held: dict[str, tuple[np.ndarray, Any, float]] = {}  # id -> (buffer, registration, expires_at)
        self._pulled: list[str] = []  # ids peers notified as read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, name="pdchat-nixl-progress", daemon=True)
        self._progress.start()

    def publish(self, kv: np.ndarray, first_token_id: int) -> KVHandle:
        self.sweep()
        dtype, kv = kv_dtype_name(kv), np.ascontiguousarray(kv)
        with self._lock:
            if self._held_bytes() + kv.nbytes > self.budget_bytes:
                raise KVBudgetExceeded(
                    f"holding {kv.nbytes >> 20} MiB more KV would pass this server's budget of "
                    f"{self.budget_bytes >> 20} MiB ({KV_BUDGET_MB.names}); retry when pulls have freed some"
                )
            registration = self._agent.register_memory([(kv.ctypes.data, kv.nbytes, 0, "")], "DRAM")
            # Connection info plus this buffer's registration: all a peer needs to READ it.
            metadata = self._agent.get_partial_agent_metadata(registration, inc_conn_info=True)
            kv_id = uuid.uuid4().hex
            expires_at = time.time() + self.ttl_s
            self._held[kv_id] = (kv, registration, expires_at)
        location = {
            "agent": self.agent_name,
            "metadata": base64.b64encode(metadata).decode(),
            "id": kv_id,
            "addr": kv.ctypes.data,
        }
        return KVHandle(self.name, tuple(kv.shape), round(expires_at, 3), first_token_id, location, dtype=dtype)

    def pull(self, handle: KVHandle, start_token: int = 0) -> np.ndarray:
        """One NIXL READ of the whole KV, then its tokens from `start_token` on.

        NOTE: the READ takes the whole buffer even when decode caches the head: a READ of
        each row's tail (a descriptor per row) failed with NIXL_ERR_NOT_FOUND on long
        prompts between servers, not yet understood (docs/kv-cache.md)."""
        addr, peer, kv_id, metadata = _located(handle)
        if time.time() > handle.expires_at:
            raise KVUnavailable(f"KV {kv_id} expired before it was pulled")
        shape = handle.shape
        if start_token and (len(shape) <= KV_TOKEN_AXIS or not 0 < start_token < shape[KV_TOKEN_AXIS]):
            raise KVUnavailable(f"cannot pull from token {start_token} of KV shaped {list(shape)}")
        kv = np.empty(shape, dtype=handle.wire_type)
        nbytes = kv.nbytes
        with self._lock:
            try:
                self._agent.add_remote_agent(base64.b64decode(metadata))
            except Exception as exc:  # noqa: BLE001
                raise KVUnavailable(f"cannot load NIXL metadata of {peer}: {exc}") from exc
            registration = self._agent.register_memory([(kv.ctypes.data, nbytes, 0, "")], "DRAM")
            try:
                local = self._agent.get_xfer_descs([(kv.ctypes.data, nbytes, 0)], "DRAM")
                remote = self._agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM")
                transfer = self._agent.initialize_xfer("READ", local, remote, peer, kv_id.encode())
                try:
                    state = self._agent.transfer(transfer)
                    deadline = time.monotonic() + PULL_TIMEOUT_S
                    wait_s = FIRST_WAIT_S
                    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                        time.sleep(wait_s)  # NOTE: a wait, never a spin: the READ runs in NIXL's own threads
                        wait_s = min(2 * wait_s, LONGEST_WAIT_S)
                        state = self._agent.check_xfer_state(transfer)
                finally:
                    self._agent.release_xfer_handle(transfer)
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own kinds
                raise KVUnavailable(f"NIXL READ of KV {kv_id} from {peer} failed: {exc}") from exc
            finally:
                self._agent.deregister_memory(registration)
        if state != "DONE":
            raise KVUnavailable(f"NIXL READ of KV {kv_id} from {peer} ended in state {state}")
        return tokens_from(kv, start_token) if start_token else kv

    def done(self, handle: KVHandle) -> None:
        """Nothing to hand back: the READ notified prefill, which freed its copy."""

    def discard(self, handle: KVHandle) -> None:
        """Notify the agent holding the handle's KV as a READ does, without the READ: it
        frees the KV at its next sweep. Raises KVUnavailable when the peer cannot be told
        (its KV then waits for its TTL)."""
        _, peer, kv_id, metadata = _located(handle)
        with self._lock:
            try:
                self._agent.add_remote_agent(base64.b64decode(metadata))
                self._agent.send_notif(peer, kv_id.encode())
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own kinds
                raise KVUnavailable(f"cannot tell {peer} to free KV {kv_id}: {exc}") from exc

    def sweep(self) -> int:
        """Free KV whose pull was notified, and KV past its TTL."""
        with self._lock:
            pulled, self._pulled = self._pulled, []
            now = time.time()
            expired = [kv_id for kv_id, (_, _, expires_at) in self._held.items() if expires_at < now]
            return sum(self._free(kv_id) for kv_id in pulled + expired)

    def held_bytes(self) -> int:
        with self._lock:
            return self._held_bytes()

    def close(self) -> None:
        self._stop.set()
        self._progress.join(5)
        with self._lock:
            for kv_id in list(self._held):
                self._free(kv_id)

    def _progress_loop(self) -> None:
        while not self._stop.wait(PROGRESS_INTERVAL_S):
            with self._lock:
                notes = self._agent.get_new_notifs()
                self._pulled += [m.decode() for messages in notes.values() for m in messages]

    def _held_bytes(self) -> int:
        return sum(buffer.nbytes for buffer, _, _ in self._held.values())

    def _free(self, kv_id: str) -> bool:
        entry = self._held.pop(kv_id, None)
        if entry is None:
            return False
        self._agent.deregister_memory(entry[1])
        return True


def _located(handle: KVHandle) -> tuple[int, str, str, Any]:
    """The handle's (address, holding agent, KV id, agent metadata); KVUnavailable naming
    what is wrong with a malformed one."""
    location = handle.location
    try:
        return int(location["addr"]), str(location["agent"]), str(location["id"]), location["metadata"]
    except (KeyError, TypeError, ValueError) as exc:
        raise KVUnavailable(f"malformed nixl KV handle: {exc!r}") from exc
