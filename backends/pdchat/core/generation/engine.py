"""The model itself: HF transformers on torch, fp32 on CPU, CUDA where present.

Prefill and decode run in different processes (and later on different servers), so
the KV cache leaves the process as one numpy array and comes back bit-identical.

Caches are plain `DynamicCache()`s, full-length in every layer, also in sliding-window
layers (GPT-OSS): the attention mask applies the window, so every layer has one layout
on the wire and in the decode batch. That spends memory on sliding layers, not
correctness (tested against a cache-free forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from pdchat.core.errors import InvalidRequest
from pdchat.core.kv.base import KV_WIRE_TYPES, kv_dtype_name
from pdchat.core.settings import DTYPE

# KV layout on the wire: [layers, 2 (key, value), kv_heads, tokens, head_dim].
KV_TOKEN_AXIS = 3


def pick_device(preference: str) -> str:
    if preference == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return preference


def pick_dtype(preference: str, device: str) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, float32 on CPU (where bf16 matmuls are slow and greedy
    outputs are compared token for token)."""
    if preference == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, preference)


@dataclass
class PrefillResult:
    last_logits: torch.Tensor  # [vocab], for the first output token
    cache: object  # transformers Cache holding the prompt's KV


class CausalLM:
    """One causal LM: prefill a prompt, step one token, move KV in and out."""

    def __init__(self, model_dir: Path, device: str = "auto", dtype: str = "auto", threads: int | None = None):
        from transformers import AutoModelForCausalLM

        if threads is not None:
            torch.set_num_threads(threads)  # process-wide: one stage model per process
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.wire_type = KV_WIRE_TYPES[self.dtype_name]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        if self.device == "cpu":
            _project_vocab_by_rows(self.model)
        config = self.model.config
        self.context_length = int(config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)
        self.num_layers = int(config.num_hidden_layers)

    @torch.inference_mode()
    def prefill(self, prompt_token_ids: list[int]) -> PrefillResult:
        """The whole prompt in one pass (prefill's model); decode's local prefill goes by chunks."""
        self.check_prompt(prompt_token_ids)
        return self.prefill_chunk(prompt_token_ids, None)

    @torch.inference_mode()
    def prefill_chunk(self, token_ids: list[int], cache: object | None) -> PrefillResult:
        """Extend `cache` (None: a new one) by `token_ids`: prefill in pieces, so a long
        prompt can share the thread with other requests' decode steps."""
        if cache is None:
            cache = DynamicCache()
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        # logits_to_keep=1: full-prompt logits would be vocab x tokens floats for nothing.
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return PrefillResult(out.logits[0, -1].float(), out.cache)

    def kv_shape(self, tokens: int) -> tuple[int, ...]:
        """The wire layout of `tokens` tokens of this model's KV."""
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return (self.num_layers, 2, heads, tokens, head_dim)

    def kv_bytes_per_token(self) -> int:
        layers, pair, heads, _, head_dim = self.kv_shape(1)
        return layers * pair * heads * head_dim * self.model.dtype.itemsize

    @torch.inference_mode()
    def step(self, token_id: int, cache: object) -> torch.Tensor:
        """Feed one token after `cache`; return the next token's logits (the cache grows)."""
        ids = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, cache=cache, use_cache=True)
        return out.logits[0, -1].float()

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidRequest("the prompt has no tokens")
        if len(prompt_token_ids) >= self.context_length:
            raise InvalidRequest(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is {self.context_length}"
            )
        low, high = min(prompt_token_ids), max(prompt_token_ids)
        if low < 0 or high >= self.vocab_size:
            raise InvalidRequest(
                f"prompt token ids must lie in [0, {self.vocab_size}); got values from {low} to {high}"
            )

    def export_kv(self, cache: object) -> np.ndarray:
        """The cache as one contiguous array in the model's dtype (see KV layout above;
        bfloat16's bits as uint16, numpy having no bfloat16)."""
        layers = [torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers]
        kv = torch.stack(layers).to("cpu").contiguous()
        return kv.view(torch.int16).numpy().view(np.uint16) if self.dtype == torch.bfloat16 else kv.numpy()

    def import_kv(self, kv: np.ndarray, prompt_tokens: int) -> object:
        """Rebuild a cache from export_kv's array, checking it fits this model and prompt."""
        self._check_kv(kv, prompt_tokens)
        cache = DynamicCache()
        tensor = torch.from_numpy(np.ascontiguousarray(kv))
        if self.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16).view(torch.bfloat16)
        tensor = tensor.to(self.device)
        for index in range(self.num_layers):
            cache.update(tensor[index, 0].unsqueeze(0), tensor[index, 1].unsqueeze(0), index)
        return cache

    def import_kv_recomputing_last(self, kv: np.ndarray, prompt_token_ids: list[int]) -> PrefillResult:
        """The prompt's cache from export_kv's array, its last token computed again for the
        logits after the prompt, which a handoff does not carry: one token, not the prompt."""
        self._check_kv(kv, len(prompt_token_ids))
        head = kv[(slice(None),) * KV_TOKEN_AXIS + (slice(None, -1),)]
        cache = self.import_kv(head, len(prompt_token_ids) - 1) if len(prompt_token_ids) > 1 else None
        return self.prefill_chunk(prompt_token_ids[-1:], cache)

    def _check_kv(self, kv: np.ndarray, prompt_tokens: int) -> None:
        """A KV from another server must be this model's, in its dtype, for this prompt (a
        prefill server running another model would otherwise fail the whole batch's step)."""
        if kv.dtype != self.wire_type:
            raise InvalidRequest(
                f"the KV is {kv_dtype_name(kv)}; this server's model runs in {self.dtype_name} "
                f"(prefill and decode servers must run the model in one dtype: {DTYPE.names})"
            )
        if tuple(kv.shape) != self.kv_shape(prompt_tokens):
            raise InvalidRequest(
                f"the KV has shape {list(kv.shape)}; this model and a prompt of {prompt_tokens} tokens "
                f"need {list(self.kv_shape(prompt_tokens))} (are prefill and decode serving the same model?)"
            )


class DecodeBatch:
    """The KV of every running sequence as one left-padded batch: one forward pass steps them all.

    Why this layout: transformers' causal LMs take a 2-D attention mask and per-row
    position ids together with a cache, so rows of different lengths step together in
    plain HF code, with no custom attention kernel or paged storage. Rows are aligned on
    the right (each row's tokens end at the last column) and masked on the left, so a
    step appends one column for every row at once. Each layer's KV lives in storage with
    room for `SPARE_ROWS` more rows and `SPARE_COLUMNS` more columns (`_RoomyLayer`): a
    step writes its column in place (no `torch.cat` of the whole cache, as transformers'
    DynamicCache does), a joining row is written into a free row, and the rows after a
    leaving one move down over it; only when the room runs out is the batch copied into
    larger storage (docs/batching.md). Padding is trimmed whenever every row has some.

    NOTE: rotary positions come from each row's own length, so padding changes no row's
    numbers beyond floating-point summation order.
    """

    SPARE_COLUMNS = 64  # room for this many steps before the storage is copied into a larger one
    SPARE_ROWS = 4  # room for this many more rows, made when a join finds none

    def __init__(self, engine: CausalLM):
        self.engine = engine
        self._cache = None  # DynamicCache of _RoomyLayers; every layer [rows, kv_heads, columns, head_dim]
        self._pads: list[int] = []  # left padding of each row

    def __len__(self) -> int:
        return len(self._pads)

    @property
    def columns(self) -> int:
        return 0 if self._cache is None else self._cache.layers[0].keys.shape[-2]

    def kv_bytes(self) -> int:
        """Bytes of KV the batch holds, padding included (not the spare room)."""
        return len(self) * self.columns * self.engine.kv_bytes_per_token()

    @torch.inference_mode()  # as step(), which may allocate the storage: inference tensors change only in it
    def join(self, cache: object) -> int:
        """Add a one-row cache (a prefilled or imported prompt); return its row. The KV is
        copied: the cache passed in (and memory it maps) is not read afterwards."""
        columns, length = self.columns, cache.layers[0].keys.shape[-2]
        if self._cache is None:
            self._cache = _cache_of([_RoomyLayer.of_row(layer.keys, layer.values) for layer in cache.layers])
        else:
            for mine, theirs in zip(self._cache.layers, cache.layers, strict=True):
                mine.add_row(theirs.keys, theirs.values)
        width = max(columns, length)
        self._pads = [pad + width - columns for pad in self._pads] + [width - length]
        return len(self._pads) - 1

    @torch.inference_mode()
    def leave(self, rows: list[int]) -> None:
        """Drop these rows (finished, cancelled or failed); their KV is overwritten or freed."""
        leaving = set(rows)
        keep = [row for row in range(len(self._pads)) if row not in leaving]
        if not keep:
            self._cache, self._pads = None, []
            return
        trim = min(self._pads[row] for row in keep)  # columns that are padding in every row left
        for layer in self._cache.layers:
            layer.keep_rows(keep, trim)
        self._pads = [self._pads[row] - trim for row in keep]

    @torch.inference_mode()
    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Feed one token per row; the next token's logits per row, [rows, vocab]."""
        rows, columns = len(self._pads), self.columns
        device = self.engine.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=device).view(rows, 1)
        pads = torch.tensor(self._pads, device=device)
        mask = (torch.arange(columns + 1, device=device).unsqueeze(0) >= pads.unsqueeze(1)).long()
        positions = (columns - pads).view(rows, 1)  # each row's own length: where its new token sits
        out = self.engine.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=self._cache, use_cache=True
        )
        self._cache = out.cache
        return out.logits[:, -1].float()


def _cache_of(layers: list[_RoomyLayer]) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = layers
    return cache


class _RoomyLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views [:rows, :, start:start + length] of
    storage with room for more rows and columns. update() writes new columns in place,
    add_row() fills a free row, keep_rows() moves rows down over those leaving; each
    copies into larger storage only when the room runs out, and keep_rows() into smaller
    once twice the room lies unused.

    Storage outside the view may hold stale KV (finite numbers, never uninitialized
    memory): whatever becomes visible is written first, or zeroed when it is padding."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: int, start: int, length: int):
        super().__init__()
        self._stored, self._rows, self._start, self._length = (keys, values), rows, start, length
        self.device, self.is_initialized = keys.device, True
        self._expose()

    @classmethod
    def of_row(cls, keys: torch.Tensor, values: torch.Tensor) -> _RoomyLayer:
        """A layer holding (a copy of) one row, [1, heads, length, head_dim], with room."""
        layer = cls(keys, values, 1, 0, keys.shape[-2])
        layer._move(1 + DecodeBatch.SPARE_ROWS, layer._length + DecodeBatch.SPARE_COLUMNS, 0)
        return layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        if self._start + self._length + new > self._stored[0].shape[-2]:
            self._move(self._stored[0].shape[0], self._length + new + DecodeBatch.SPARE_COLUMNS, 0)
        end = self._start + self._length
        self._stored[0][: self._rows, :, end : end + new] = key_states
        self._stored[1][: self._rows, :, end : end + new] = value_states
        self._length += new
        self._expose()
        return self.keys, self.values

    def add_row(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append one row, [1, heads, its length, head_dim], aligned on the right with the
        others; a row longer than the batch widens it on the left, as padding of the rest."""
        length = keys.shape[-2]
        widen = max(0, length - self._length)
        if self._rows == self._stored[0].shape[0] or widen > self._start:
            room = self._length + widen + DecodeBatch.SPARE_COLUMNS
            self._move(self._rows + 1 + DecodeBatch.SPARE_ROWS, room, widen)
        if widen:
            self._start -= widen
            self._length += widen
            for stored in self._stored:
                stored[: self._rows, :, self._start : self._start + widen] = 0
        end = self._start + self._length
        for stored, new in zip(self._stored, (keys, values), strict=True):
            stored[self._rows, :, self._start : end - length] = 0
            stored[self._rows, :, end - length : end] = new[0]
        self._rows += 1
        self._expose()

    def keep_rows(self, keep: list[int], trim: int) -> None:
        """Keep these rows (ascending), moved down into the first rows, without the first
        `trim` columns (padding in all of them)."""
        end = self._start + self._length
        for slot, row in enumerate(keep):
            if slot != row:
                for stored in self._stored:
                    stored[slot, :, self._start : end] = stored[row, :, self._start : end]
        self._rows, self._start, self._length = len(keep), self._start + trim, self._length - trim
        rows_room, columns_room = self._stored[0].shape[0], self._stored[0].shape[-2]
        # Twice the room unused: the storage shrinks, so it never holds much more than the batch.
        if (
            rows_room > self._rows + 2 * DecodeBatch.SPARE_ROWS
            or columns_room > self._length + 2 * DecodeBatch.SPARE_COLUMNS
        ):
            self._move(self._rows + DecodeBatch.SPARE_ROWS, self._length + DecodeBatch.SPARE_COLUMNS, 0)
        self._expose()

    def _move(self, rows: int, columns: int, left: int) -> None:
        """Copy the view into new zeroed storage of [rows, ..., columns, ...], at column `left`."""
        end = self._start + self._length
        moved = tuple(_storage(stored, rows, columns) for stored in self._stored)
        for new, old in zip(moved, self._stored, strict=True):
            new[: self._rows, :, left : left + self._length] = old[: self._rows, :, self._start : end]
        self._stored, self._start = moved, left

    def _expose(self) -> None:
        end = self._start + self._length
        self.keys, self.values = (stored[: self._rows, :, self._start : end] for stored in self._stored)


def _storage(like: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """Zeroed [rows, heads, columns, head_dim] storage for KV like `like` (zeros: padding
    columns are masked, and must not hold NaNs that 0 * NaN would spread)."""
    return like.new_zeros((rows, like.shape[1], columns, like.shape[3]))


def _project_vocab_by_rows(model: torch.nn.Module) -> None:
    """Give a CPU model an output projection that picks its GEMM by row count.

    Why: nn.Linear multiplies by its [vocab, hidden] weight transposed, which MKL's fp32
    GEMM does slowly for the few rows a decode step has, and which of the other two
    layouts is fastest depends on the rows. On the tiny model (vocab 49k, hidden 256), ms
    per projection, nn.Linear / x @ W^T (W^T stored) / (W @ x^T)^T: 1 row 6.6 / 2.4 / 6.5;
    4 rows 10.4 / 8.1 / 4.0; 8 rows 11.7 / 9.7 / 6.1; 16 rows 14.0 / 11.4 / 13.5. The
    copy costs the projection's size again (its weight is also kept for 2-8 rows)."""
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:
        model.set_output_embeddings(_VocabProjection(head))


class _VocabProjection(torch.nn.Module):
    """nn.Linear's result, by whichever GEMM layout is fastest for this many rows."""

    FEW_ROWS = range(2, 9)  # rows for which W @ x^T beat x @ W^T (see above)

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight  # [vocab, hidden], shared with tied input embeddings
        self.weight_t = torch.nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        if rows.shape[0] in self.FEW_ROWS:
            out = (self.weight @ rows.t()).t()
        else:
            out = rows @ self.weight_t
        out = out.reshape(*hidden.shape[:-1], -1)
        return out if self.bias is None else out + self.bias
