"""vLLM's KV-event types as a consumer declares them, written from vLLM's field list
independently of pdchat.core.kv_events: what the tests decode with. The module's names are
current vLLM's layout (each event a map, its tag under "type", as vLLM 0.32 declares them);
`ARRAY` holds the positional layout of vLLM before its PR #42892.

NOTE: no postponed annotations here: each layout's batch names its own event classes."""

from types import SimpleNamespace
from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _layout(array_like: bool) -> SimpleNamespace:
    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return SimpleNamespace(
        KVCacheEvent=KVCacheEvent,
        BlockStored=BlockStored,
        BlockRemoved=BlockRemoved,
        AllBlocksCleared=AllBlocksCleared,
        KVEventBatch=KVEventBatch,
    )


ARRAY = _layout(array_like=True)
_MAP = _layout(array_like=False)
KVCacheEvent = _MAP.KVCacheEvent
BlockStored = _MAP.BlockStored
BlockRemoved = _MAP.BlockRemoved
AllBlocksCleared = _MAP.AllBlocksCleared
KVEventBatch = _MAP.KVEventBatch
