"""Paged KV: one pool of fixed-size blocks per model instance, a block table per sequence,
and a prefix cache over full blocks.

Storage: every layer's keys and values as `[slots, kv_heads, head_dim]` in one tensor
each, `[layers, slots, ...]`; slot = block * block_tokens + offset. A sequence holds the
blocks its block table names, so the memory held is the blocks used, whatever the other
sequences' lengths. Block 0 is never handed out: it stays zero and pads the gather of
rows shorter than the longest, masked out.

Prefix cache: a full block is keyed by a chained hash (its parent block's hash and its
token ids; the root hash carries the model and the request's `cache_salt`, so tenants
with different salts share nothing). A full block stays keyed after its sequence ends;
a later sequence whose prompt starts with the same blocks takes them (a reference each)
and computes only the rest. Unreferenced keyed blocks are evicted least recently used
when the pool needs room.

Why our own pool and not transformers' `PagedAttentionCache`: that cache belongs to its
continuous-batching manager (its scheduler, request states, sampling and memory sizing)
and has no import or export of one sequence's blocks, which P/D needs on both ends, nor a
place for our per-request sampling, grammar masks and admission. What we do take from
transformers is the model code: `paged_attention` is registered on its attention
interface (`AttentionInterface`), so the model computes q, k, v and rotary embeddings as
always and this module only stores k, v and attends over each row's blocks.

NOTE: one thread uses a pool at a time (prefill's execute, decode's scheduler thread).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import AttentionInterface

from pdchat.core.errors import Unavailable

if TYPE_CHECKING:
    from pdchat.core.generation.cpu_kernels import DecodeKernels
    from pdchat.core.kv_events import BlockEvents

PAGED_ATTENTION = "pdchat_paged"
NULL_BLOCK = 0  # zeros, never handed out: what pads a short row's gather
_HASH_BYTES = 8


class PoolExhausted(Unavailable):
    """The pool has no free or evictable block left."""


def root_hash(model_key: str, cache_salt: str | None) -> int:
    """The parent of a sequence's first block: the model and the tenant's salt."""
    digest = hashlib.blake2b(f"{model_key}\0{cache_salt or ''}".encode(), digest_size=_HASH_BYTES).digest()
    return int.from_bytes(digest, "little")


def block_hash(parent: int, token_ids: list[int]) -> int:
    """A full block's key: its parent's key and its token ids."""
    data = parent.to_bytes(_HASH_BYTES, "little") + np.asarray(token_ids, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=_HASH_BYTES).digest(), "little")


@dataclass(frozen=True)
class PoolUsage:
    total_blocks: int  # blocks a sequence may use (the null block not counted)
    used_blocks: int  # referenced by a live sequence
    cached_blocks: int  # keyed and unreferenced: reusable, evicted when room is needed
    block_tokens: int
    # Since the pool was made, in tokens: prompts looked up in the prefix cache, what it
    # gave, and what forward passes computed of prompts (all of it without a cache).
    queried_tokens: int = 0
    hit_tokens: int = 0
    computed_prompt_tokens: int = 0


class BlockPool:
    """The KV storage of one model instance, handed out by block."""

    def __init__(
        self,
        *,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_tokens: int,
        blocks: int,
        dtype: torch.dtype,
        device: str,
        prefix_caching: bool = True,
    ):
        if blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (one is the null block); got {blocks}")
        self.block_tokens = block_tokens
        self.prefix_caching = prefix_caching
        shape = (layers, blocks * block_tokens, kv_heads, head_dim)
        # Zeros: padding gathers read block 0, and masked scores must not meet NaNs.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._refs = [0] * blocks
        self._free = list(range(blocks - 1, NULL_BLOCK, -1))  # popped from the end: low blocks first
        self._hash_of: dict[int, int] = {}  # block -> its key
        self._block_of: dict[int, int] = {}  # key -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed unreferenced blocks, oldest first
        self.evictions = 0
        self.queried_tokens = self.hit_tokens = self.computed_prompt_tokens = 0
        # KV events (pdchat.core.kv_events): told of each block keyed, keyed block evicted,
        # cache cleared; None: off. It only queues, so it costs a step nothing to speak of.
        self.events: BlockEvents | None = None

    @property
    def total_blocks(self) -> int:
        return len(self._refs) - 1

    def usage(self) -> PoolUsage:
        cached = len(self._evictable)
        used = self.total_blocks - len(self._free) - cached
        return PoolUsage(
            self.total_blocks,
            used,
            cached,
            self.block_tokens,
            self.queried_tokens,
            self.hit_tokens,
            self.computed_prompt_tokens,
        )

    def available(self) -> int:
        """Blocks an allocation can take now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks, each with one reference; evicts cached blocks for room."""
        if count > self.available():
            raise PoolExhausted(
                f"the KV pool has {self.available()} of {self.total_blocks} blocks free; {count} are needed"
            )
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                key = self._hash_of.pop(block)
                del self._block_of[key]
                self.evictions += 1
                if self.events is not None:
                    self.events.removed(key)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of a sequence's `blocks` (in its order); a block left
        unreferenced is cached if keyed, else freed.

        NOTE: released last first, so a chain's tail joins the eviction order before its
        head and is evicted first: a cached block's parent outlives it, and a partly evicted
        chain still serves its head (a head evicted first would leave its tail cached but
        unreachable)."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def cached_run(self, keys: list[int]) -> int:
        """How many of `keys`, from the first, the pool caches now (lookup's count, nothing taken)."""
        if not self.prefix_caching:
            return 0
        count = 0
        for key in keys:
            if key not in self._block_of:
                break
            count += 1
        return count

    def lookup(self, keys: list[int]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the first, each with a
        reference taken (and out of the eviction order)."""
        blocks = [self._block_of[key] for key in keys[: self.cached_run(keys)]]
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        return blocks

    def key(
        self,
        block: int,
        key: int,
        parent: int | None = None,
        token_ids: list[int] | None = None,
        extra_keys: tuple[str, ...] | None = None,
    ) -> None:
        """Key a full block for reuse; a key another block already holds stays with that one.
        `parent` (the previous block's key, None for a sequence's first), `token_ids` and
        `extra_keys` (what else the key covers) are for the KV events only."""
        if self.prefix_caching and key not in self._block_of and block not in self._hash_of:
            self._block_of[key] = block
            self._hash_of[block] = key
            if self.events is not None:
                self.events.stored(key, parent, token_ids or [], extra_keys)

    def clear_cache(self) -> int:
        """Forget every cached block (referenced ones stay with their sequences); how many were dropped."""
        dropped = len(self._block_of)
        for block in self._evictable:
            self._free.append(block)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()
        if self.events is not None:
            self.events.cleared()
        return dropped


class Sequence:
    """One sequence's KV in a pool: its block table, the tokens whose KV it holds, the
    keys of its full blocks.

    `cached_tokens`: how many of its leading tokens came from the prefix cache; `cache_salt`:
    its tenant's salt, inside `root` (root_hash) and told with its first block's KV event."""

    def __init__(self, pool: BlockPool, root: int, cache_salt: str | None = None):
        self.pool = pool
        self.cache_salt = cache_salt
        self.blocks: list[int] = []
        self.token_ids: list[int] = []
        self.cached_tokens = 0
        self._keys: list[int] = []  # of its full blocks, in order
        self._root = root

    def __len__(self) -> int:
        return len(self.token_ids)

    def prefix_keys(self, prompt_token_ids: list[int]) -> list[int]:
        """The keys of the prompt's blocks a cached prefix may hold: its full blocks but the
        one its last token is in (its logits are wanted)."""
        size = self.pool.block_tokens
        return self._chain(prompt_token_ids[: (len(prompt_token_ids) - 1) // size * size])

    def reuse_prefix(self, prompt_token_ids: list[int], keys: list[int] | None = None) -> int:
        """Take the cached blocks the prompt starts with (`keys`: its prefix_keys, if known),
        leaving at least its last token to compute; how many tokens they hold."""
        assert not self.blocks, "a prefix is reused only by a new sequence"
        size = self.pool.block_tokens
        keys = self.prefix_keys(prompt_token_ids) if keys is None else keys
        blocks = self.pool.lookup(keys)
        self.blocks, self._keys = blocks, keys[: len(blocks)]
        self.token_ids = list(prompt_token_ids[: len(blocks) * size])
        self.cached_tokens = len(self.token_ids)
        self.pool.queried_tokens += len(prompt_token_ids)
        self.pool.hit_tokens += self.cached_tokens
        return self.cached_tokens

    def extend(self, token_ids: list[int]) -> None:
        """Make room for `token_ids` after the held ones (PoolExhausted if the pool has
        none). They count as held from here: the forward pass that writes their KV comes next."""
        end = len(self.token_ids) + len(token_ids)
        needed = -(-end // self.pool.block_tokens) - len(self.blocks)
        if needed > 0:
            self.blocks.extend(self.pool.allocate(needed))
        self.token_ids.extend(token_ids)

    def release(self) -> None:
        """Give the blocks back (keyed ones stay cached); the sequence holds nothing after."""
        blocks, self.blocks = self.blocks, []
        self.pool.release(blocks)
        self.token_ids, self._keys = [], []

    def _chain(self, token_ids: list[int]) -> list[int]:
        size, keys, parent = self.pool.block_tokens, [], self._root
        for start in range(0, len(token_ids) - size + 1, size):
            parent = block_hash(parent, token_ids[start : start + size])
            keys.append(parent)
        return keys

    def written(self) -> None:
        """The forward pass wrote the held tokens' KV: key the blocks now full, for reuse.
        NOTE: only after the write, so a failed pass never leaves a keyed block of garbage."""
        if not self.pool.prefix_caching:
            return
        size = self.pool.block_tokens
        parent = self._keys[-1] if self._keys else self._root
        while (len(self._keys) + 1) * size <= len(self.token_ids):
            index = len(self._keys)
            tokens = self.token_ids[index * size : (index + 1) * size]
            previous = parent if index else None  # the root is no block
            extra = (self.cache_salt,) if index == 0 and self.cache_salt else None
            parent = block_hash(parent, tokens)
            self._keys.append(parent)
            self.pool.key(self.blocks[index], parent, previous, tokens, extra)


@dataclass
class PagedForward:
    """What one forward pass's attention needs, the same in every layer.

    `write`: the slots of the pass's new tokens, in input order (row-major over rows and
    their tokens). `read`: [rows, columns] slots each row attends over, positions 0.. of
    the sequence (NULL_BLOCK's slot 0 past a row's length). `query_positions`: [rows,
    queries] each query token's position; key j of a row is at position j."""

    pool: BlockPool
    write: torch.Tensor
    read: torch.Tensor
    query_positions: torch.Tensor
    full_rows: bool = False  # every row attends over all its columns: no mask needed without a window
    causal: bool = False  # one row whose queries are all its columns: SDPA's is_causal is the mask
    # The C kernels for passes of one query per row (CPU, fp32), None: the torch path.
    decode_kernels: DecodeKernels | None = None
    _masks: dict | None = None
    _lengths: torch.Tensor | None = None

    def lengths(self) -> torch.Tensor:
        """[rows] how many columns each row's last query attends over; built once per pass
        (the C attention checks them against `read`)."""
        if self._lengths is None:
            self._lengths = self.query_positions[:, -1] + 1
        return self._lengths

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[rows, 1, queries, columns], True where a query may attend (causal, within its
        row's length, within `sliding_window` when given); built once per pass and window."""
        if self._masks is None:
            self._masks = {}
        if sliding_window not in self._masks:
            self._masks[sliding_window] = self._build_mask(sliding_window)
        return self._masks[sliding_window]

    def attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scaling: float | None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """torch's SDPA of query [rows, q_heads, queries, dim] over keys and values [rows,
        kv_heads, columns, dim] (grouped heads), masked as this pass needs: not at all where
        every row attends over all its columns, causally by SDPA itself where `causal`, else
        by `mask(sliding_window)`."""
        plain = sliding_window is None and (self.full_rows or self.causal)
        return torch.nn.functional.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=None if plain else self.mask(sliding_window),
            is_causal=plain and self.causal,
            scale=scaling,
            enable_gqa=True,
        )

    def _build_mask(self, sliding_window: int | None) -> torch.Tensor:
        columns = torch.arange(self.read.shape[1], device=self.read.device).view(1, 1, -1)
        queries = self.query_positions.unsqueeze(-1)  # [rows, queries, 1]
        allowed = columns <= queries
        if sliding_window is not None:
            allowed = allowed & (columns > queries - sliding_window)
        return allowed.unsqueeze(1)


@dataclass
class PromptSegments:
    """Several prompts' chunks in one pass: their tokens one after another in a single row
    of input ids, `parts[i]` the paged view of chunk i alone (one row, its `write`, `read`
    and `query_positions`). Everything but attention is row-wise, so the pass computes it
    over all the tokens at once; each chunk attends over its own sequence only."""

    parts: list[PagedForward]

    @property
    def decode_kernels(self) -> DecodeKernels | None:
        return self.parts[0].decode_kernels

    def bounds(self) -> list[tuple[int, int]]:
        """Each chunk's [start, end) in the pass's tokens."""
        ends = np.cumsum([part.query_positions.shape[1] for part in self.parts]).tolist()
        return list(zip([0, *ends[:-1]], ends, strict=True))


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    paged: PagedForward | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the pool: store this pass's keys and values
    (query/key/value [rows, heads, queries, head_dim]) at `paged.write`, then attend over
    each row's slots. Returns [rows, queries, heads, head_dim], as every interface does."""
    if paged is None:
        raise RuntimeError("paged attention runs only inside CausalLM's forward passes (no PagedForward given)")
    layer = module.layer_idx
    rows, kv_heads, queries, head_dim = key.shape
    pool_keys, pool_values = paged.pool.keys[layer], paged.pool.values[layer]
    pool_keys.index_copy_(0, paged.write, key.transpose(1, 2).reshape(-1, kv_heads, head_dim))
    pool_values.index_copy_(0, paged.write, value.transpose(1, 2).reshape(-1, kv_heads, head_dim))
    if paged.decode_kernels is not None and queries == 1 and s_aux is None:
        scale = head_dim**-0.5 if scaling is None else scaling
        query = query.reshape(rows, -1, head_dim)
        out = paged.decode_kernels.attention(
            query, pool_keys, pool_values, paged.read, paged.lengths(), scale, sliding_window
        )
        return out.view(rows, 1, -1, head_dim), None
    keys, values = (read_slots(paged, slots) for slots in (pool_keys, pool_values))
    if s_aux is not None:
        out = _attention_with_sinks(query, keys, values, paged.mask(sliding_window), scaling, s_aux)
    else:
        out = paged.attend(query, keys, values, scaling, sliding_window)
    return out.transpose(1, 2).contiguous(), None


def read_slots(paged: PagedForward, slots: torch.Tensor) -> torch.Tensor:
    """What each row attends over, from one layer's pool `slots` [slots, kv_heads, head_dim]:
    [rows, kv_heads, columns, head_dim] (`paged.read`'s slots, gathered)."""
    rows, columns = paged.read.shape
    return slots.index_select(0, paged.read.reshape(-1)).view(rows, columns, *slots.shape[1:]).transpose(1, 2)


def _attention_with_sinks(query, keys, values, mask, scaling, sinks) -> torch.Tensor:
    """Softmax attention whose denominator also holds a learned per-head sink logit (GPT-OSS)."""
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights.to(values.dtype), values)


AttentionInterface.register(PAGED_ATTENTION, paged_attention)
