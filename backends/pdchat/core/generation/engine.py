"""The model itself: HF transformers on torch, fp32 on CPU, CUDA where present.

Prefill and decode run in different processes (and later on different servers), so
the KV cache leaves the process as one numpy array and comes back bit-identical.

KV lives in the instance's block pool (core.generation.paged): a sequence holds the
blocks it uses, decode's rows step together over their own blocks (no padding held),
and prompts that start alike share their leading blocks through the prefix cache.
Sliding-window layers (GPT-OSS) keep every block too: the window is applied in
attention, so every layer has one layout on the wire and in the pool.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pdchat.core.engine_api import OWN_LLAMA, TRANSFORMERS, ExecutionPath, KVSource
from pdchat.core.errors import InvalidRequest, Unavailable
from pdchat.core.generation import cpu_kernels, llama, runners
from pdchat.core.generation.paged import (
    NULL_BLOCK,
    PAGED_ATTENTION,
    BlockPool,
    PagedForward,
    PromptSegments,
    Sequence,
    root_hash,
)
from pdchat.core.generation.projection import RowGemm
from pdchat.core.kv.base import KV_TOKEN_AXIS, KV_WIRE_TYPES, kv_dtype_name
from pdchat.core.settings import DEFAULT_KV_POOL, DTYPE, KVPoolOptions


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


class CausalLM:
    """One causal LM over one block pool: prefill a prompt, step rows, move KV in and out.

    `forward` (setting FORWARD): `auto` runs pdchat's own forward pass for Llama-architecture
    models in fp32 (core.generation.llama) and, on CPU in fp32, decode's work between its GEMMs
    and its greedy argmax in C on the pass's threads (core.generation.cpu_kernels, when this
    host has them built);
    `transformers` runs transformers' forward with torch attention for every model.

    Which of those computes the passes is decided once, at load: one runner
    (core.generation.runners) that every pass calls; `path` names it."""

    def __init__(
        self,
        model_dir: Path,
        device: str = "auto",
        dtype: str = "auto",
        threads: int | None = None,
        pool: KVPoolOptions = DEFAULT_KV_POOL,
        forward: str = "auto",
    ):
        from transformers import AutoModelForCausalLM

        if threads is not None:
            torch.set_num_threads(threads)  # process-wide: one stage model per process
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.wire_type = KV_WIRE_TYPES[self.dtype_name]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype, attn_implementation=PAGED_ATTENTION)
        self.model = model.to(self.device).eval()
        if self.device == "cpu":
            _project_vocab_by_rows(self.model)
        own = forward == "auto"
        self._own_forward = llama.LlamaForward(self.model) if own and llama.supports(self.model) else None
        # The kernels split their rows over the pass's threads (set_threads), as torch's GEMMs do.
        cpu_fp32 = self.device == "cpu" and self.dtype == torch.float32
        self._kernels = cpu_kernels.load(cpu_kernels.library_dir()) if own and cpu_fp32 else None
        if self._kernels is not None:
            self._kernels.set_threads(torch.get_num_threads())
        self._greedy_enabled = True
        self._heads: dict[int, cpu_kernels.GreedyHead | None] = {}  # by id(kernels): made once each
        self._runner = self._choose_runner()
        config = self.model.config
        self.context_length = int(config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)
        self.num_layers = int(config.num_hidden_layers)
        self._model_key = f"{Path(model_dir).resolve()}:{self.dtype_name}"
        _, _, heads, _, head_dim = self.kv_shape(1)
        blocks = 1 + pool.bytes // (self.kv_bytes_per_token() * pool.block_tokens)
        self.pool = BlockPool(
            layers=self.num_layers,
            kv_heads=heads,
            head_dim=head_dim,
            block_tokens=pool.block_tokens,
            blocks=max(2, blocks),
            dtype=self.dtype,
            device=self.device,
            prefix_caching=pool.prefix_caching,
        )

    def set_threads(self, threads: int) -> None:
        """The torch threads (process-wide) and, when this engine has them, the C kernels' for
        the passes that follow."""
        torch.set_num_threads(threads)
        if self._kernels is not None:
            self._kernels.set_threads(threads)

    def _choose_runner(self) -> runners.Runner:
        """The runner every pass takes (core.generation.runners), from the forward, the kernels
        and the GreedyHead this engine has; the GreedyHead is made here, not on a first request
        (its bf16 copy takes ~0.1 s)."""
        if self._own_forward is None:
            return runners.TransformersRunner(self.model, self._kernels)
        head = self._greedy_head() if self._greedy_enabled else None
        if head is None:
            return runners.OwnForwardRunner(self.model, self._kernels, self._own_forward)
        return runners.GreedyHeadRunner(self.model, self._kernels, self._own_forward, head)

    def _greedy_head(self) -> cpu_kernels.GreedyHead | None:
        """The vocabulary projection's GreedyHead where one serves (the C kernels with AVX-512
        BF16 or AVX2 and FMA, a projection without bias), made once per set of kernels."""
        if self._kernels is None:
            return None
        key = id(self._kernels)
        if key not in self._heads:
            head = self.model.get_output_embeddings()
            fits = (
                isinstance(head, _VocabProjection)
                and head.bias is None
                and cpu_kernels.GreedyHead.fits(self._kernels, head.weight)
            )
            self._heads[key] = cpu_kernels.GreedyHead(self._kernels, head.weight, project=head) if fits else None
        return self._heads[key]

    @property
    def path(self) -> ExecutionPath:
        """What computes this engine's passes, for the startup log and the engine-info metric."""
        head = getattr(self._runner, "head", None)
        return ExecutionPath(
            device=self.device,
            dtype=self.dtype_name,
            forward=TRANSFORMERS if self._own_forward is None else OWN_LLAMA,
            kernels=None if self._kernels is None else self._kernels.isa,
            kernel_threads=torch.get_num_threads(),
            greedy_head=() if head is None else tuple(way for way in head.way_names if way != "fp32"),
        )

    # The parts of the runner, swappable on a loaded engine (benchmarks and tests compare the
    # paths on one model): each change chooses the runner again, never a pass.

    @property
    def llama(self) -> llama.LlamaForward | None:
        """pdchat's own forward pass, None where transformers' runs."""
        return self._own_forward

    @llama.setter
    def llama(self, forward: llama.LlamaForward | None) -> None:
        self._own_forward = forward
        self._runner = self._choose_runner()

    @property
    def decode_kernels(self) -> cpu_kernels.DecodeKernels | None:
        """The C kernels the passes run, None where they take torch ops."""
        return self._kernels

    @decode_kernels.setter
    def decode_kernels(self, kernels: cpu_kernels.DecodeKernels | None) -> None:
        self._kernels = kernels
        self._runner = self._choose_runner()

    def use_greedy_head(self, enabled: bool) -> None:
        """Let step_rows and a prompt's last prefill chunk decide greedy rows by the GreedyHead
        where it serves (the default), or not."""
        self._greedy_enabled = enabled
        self._runner = self._choose_runner()

    def sequence(self, cache_salt: str | None = None) -> Sequence:
        """A new, empty sequence in the pool; it shares cached blocks only with sequences
        of the same `cache_salt`."""
        return Sequence(self.pool, root_hash(self._model_key, cache_salt), cache_salt)

    def check_fits(self, tokens: int) -> None:
        """A sequence of `tokens` tokens can be held by this pool at all (Unavailable if not)."""
        blocks = -(-tokens // self.pool.block_tokens)
        if blocks > self.pool.total_blocks:
            raise Unavailable(
                f"{tokens} tokens of KV need {blocks} blocks; this server's whole KV pool holds "
                f"{self.pool.total_blocks} ({self.pool.total_blocks * self.pool.block_tokens} tokens): "
                "raise prefill_kv_mb / decode_kv_mb"
            )

    def prefill(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> tuple[torch.Tensor, Sequence]:
        """The prompt's KV in a new sequence, its cached prefix reused, in one pass; the logits after it."""
        prompt = PromptPrefill(self, prompt_token_ids, cache_salt, chunk=len(prompt_token_ids))
        logits, _ = prompt.step()
        return logits, prompt.sequence

    def prefill_chunk(self, sequence: Sequence, token_ids: list[int]) -> torch.Tensor:
        """Extend `sequence` by `token_ids` in one pass (decode's local prefill goes by
        chunks, between the batch's steps); the logits after the last of them."""
        logits, _ = self.prefill_chunk_choosing(sequence, token_ids, greedy=False)
        return logits

    @torch.inference_mode()
    def prefill_chunk_choosing(
        self, sequence: Sequence, token_ids: list[int], greedy: bool
    ) -> tuple[torch.Tensor | None, int | None]:
        """prefill_chunk(), and, if `greedy`, the greedy token after the chunk: step_rows'
        pair for one row (the logits are None where the GreedyHead decided the token
        without them)."""
        start = len(sequence)
        sequence.extend(token_ids)
        read = self._read_slots([sequence])
        positions = torch.arange(start, len(sequence), device=self.device).view(1, -1)
        paged = self._paged(read[0, start:], read, positions, causal=start == 0)
        rows, chosen = self._runner.project_last(
            torch.tensor([token_ids], dtype=torch.long, device=self.device), paged, [greedy]
        )
        sequence.written()
        self.pool.computed_prompt_tokens += len(token_ids)
        return rows[0], chosen[0]

    @property
    def batches_prompts(self) -> bool:
        """Whether prefill_chunks computes several chunks in one pass (pdchat's own forward)
        rather than one after another."""
        return self._own_forward is not None

    @torch.inference_mode()
    def prefill_chunks(
        self, chunks: list[tuple[Sequence, list[int], bool]]
    ) -> list[tuple[torch.Tensor | None, int | None]]:
        """prefill_chunk_choosing() of each (sequence, token ids, greedy), in one pass where
        the engine `batches_prompts`: row-wise work over all the chunks' tokens at once, each
        chunk attending over its own sequence. Each chunk's results are the same bits as alone
        where the GEMMs are blocked and the C prompt attention runs (batch invariance,
        core.generation.projection), to rounding otherwise. NOTE: the sequences must differ."""
        if len(chunks) == 1 or not self.batches_prompts:
            return [self.prefill_chunk_choosing(*chunk) for chunk in chunks]
        parts = []
        for sequence, token_ids, _ in chunks:
            start = len(sequence)
            sequence.extend(token_ids)
            read = self._read_slots([sequence])
            positions = torch.arange(start, len(sequence), device=self.device).view(1, -1)
            parts.append(self._paged(read[0, start:], read, positions, causal=start == 0))
        input_ids = torch.tensor([[t for _, token_ids, _ in chunks for t in token_ids]], device=self.device)
        rows, chosen = self._runner.project_last(input_ids, PromptSegments(parts), [greedy for *_, greedy in chunks])
        for sequence, token_ids, _ in chunks:
            sequence.written()
            self.pool.computed_prompt_tokens += len(token_ids)
        return list(zip(rows, chosen, strict=True))

    @torch.inference_mode()
    def step(self, sequences: list[Sequence], token_ids: list[int]) -> torch.Tensor:
        """Feed one token to each sequence, all in one pass; the next token's logits, [rows, vocab]."""
        input_ids, paged = self._step_inputs(sequences, token_ids)
        logits = self._runner.last_logits(input_ids, paged)
        for sequence in sequences:
            sequence.written()
        return logits

    @torch.inference_mode()
    def step_rows(
        self, sequences: list[Sequence], token_ids: list[int], greedy: list[bool]
    ) -> tuple[list[torch.Tensor | None], list[int | None]]:
        """step(), for rows of which those marked `greedy` need only their argmax: per row,
        its logits [vocab] (None for a greedy row whose token the GreedyHead decided without
        them) and its greedy token (None for rows not greedy)."""
        input_ids, paged = self._step_inputs(sequences, token_ids)
        rows, chosen = self._runner.project_last(input_ids, paged, greedy)
        for sequence in sequences:
            sequence.written()
        return rows, chosen

    def _step_inputs(self, sequences: list[Sequence], token_ids: list[int]) -> tuple[torch.Tensor, PagedForward]:
        """Extend each sequence by its token: the pass's input ids [rows, 1] and its paged view."""
        for sequence, token_id in zip(sequences, token_ids, strict=True):
            sequence.extend([token_id])
        lengths = torch.tensor([len(s) for s in sequences], device=self.device)
        read = self._read_slots(sequences)
        rows = torch.arange(len(sequences), device=self.device)
        positions = (lengths - 1).view(-1, 1)
        full_rows = bool((lengths == read.shape[1]).all())
        paged = self._paged(read[rows, lengths - 1], read, positions, full_rows=full_rows)
        return torch.tensor(token_ids, dtype=torch.long, device=self.device).view(-1, 1), paged

    def _paged(self, write: torch.Tensor, read: torch.Tensor, positions: torch.Tensor, **flags: bool) -> PagedForward:
        return PagedForward(self.pool, write, read, positions, decode_kernels=self._runner.kernels, **flags)

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each row's greedy token of `logits` [rows, vocab] (the first on a tie)."""
        return self._runner.argmax(logits)

    def _read_slots(self, sequences: list[Sequence]) -> torch.Tensor:
        """[rows, longest] the slots of each sequence's positions, the null slot past its end."""
        size = self.pool.block_tokens
        width = max(len(s.blocks) for s in sequences)
        table = torch.tensor([s.blocks + [NULL_BLOCK] * (width - len(s.blocks)) for s in sequences])
        lengths = torch.tensor([len(s) for s in sequences]).view(-1, 1)
        positions = torch.arange(int(lengths.max()))
        slots = table[:, positions // size] * size + positions % size
        return slots.masked_fill(positions >= lengths, NULL_BLOCK * size).to(self.device)

    def kv_shape(self, tokens: int) -> tuple[int, ...]:
        """The wire layout of `tokens` tokens of this model's KV."""
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return (self.num_layers, 2, heads, tokens, head_dim)

    def kv_bytes_per_token(self) -> int:
        layers, pair, heads, _, head_dim = self.kv_shape(1)
        return layers * pair * heads * head_dim * self.model.dtype.itemsize

    def kv_bytes_held(self) -> int:
        """Bytes of KV the pool's live sequences hold (whole blocks; cached blocks not counted)."""
        return self.pool.usage().used_blocks * self.pool.block_tokens * self.kv_bytes_per_token()

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

    @torch.inference_mode()
    def export_kv(self, sequence: Sequence) -> np.ndarray:
        """The sequence's KV as one contiguous array in the model's dtype (see KV layout
        above; bfloat16's bits as uint16, numpy having no bfloat16)."""
        slots = self._read_slots([sequence])[0]
        kv = torch.stack((self.pool.keys[:, slots], self.pool.values[:, slots]), dim=1)  # [layers, 2, T, heads, dim]
        kv = kv.transpose(2, 3).to("cpu").contiguous()
        return kv.view(torch.int16).numpy().view(np.uint16) if self.dtype == torch.bfloat16 else kv.numpy()

    @torch.inference_mode()
    def import_kv(self, pull: KVSource, prompt_token_ids: list[int], cache_salt: str | None = None) -> Sequence | None:
        """A sequence holding this prompt's KV: the leading blocks this pool caches are taken
        from the cache, and only the rest is pulled (`pull(start)`: export_kv's array of
        tokens [start:], checked to fit this model and prompt). None when the pull fails;
        then nothing is held."""
        self.check_fits(len(prompt_token_ids))
        sequence = self.sequence(cache_salt)
        try:
            cached = sequence.reuse_prefix(prompt_token_ids) if len(prompt_token_ids) > 1 else 0
            kv = pull(cached)
            if kv is None:
                sequence.release()
                return None
            self._check_kv(kv, len(prompt_token_ids) - cached, len(prompt_token_ids))
            sequence.extend(prompt_token_ids[cached:])
            tensor = torch.from_numpy(np.ascontiguousarray(kv))
            if self.dtype == torch.bfloat16:
                tensor = tensor.view(torch.int16).view(torch.bfloat16)
            tensor = tensor.to(self.device).transpose(2, 3)  # [layers, 2, T, heads, dim]
            slots = self._read_slots([sequence])[0, cached:]
            self.pool.keys[:, slots] = tensor[:, 0]
            self.pool.values[:, slots] = tensor[:, 1]
            sequence.written()
        except BaseException:
            sequence.release()
            raise
        return sequence

    def import_kv_recomputing_last(
        self, pull: KVSource, prompt_token_ids: list[int], cache_salt: str | None = None
    ) -> tuple[torch.Tensor, Sequence] | None:
        """As import_kv, with the prompt's last token computed again for the logits after the
        prompt, which a handoff does not carry: one token, not the prompt."""
        if len(prompt_token_ids) == 1:
            return self.prefill(prompt_token_ids, cache_salt)

        def all_but_last(start: int) -> np.ndarray | None:
            kv = pull(start)
            if kv is not None:
                self._check_kv(kv, len(prompt_token_ids) - start, len(prompt_token_ids))
                kv = kv[(slice(None),) * KV_TOKEN_AXIS + (slice(None, -1),)]
            return kv

        sequence = self.import_kv(all_but_last, prompt_token_ids[:-1], cache_salt)
        if sequence is None:
            return None
        try:
            return self.prefill_chunk(sequence, prompt_token_ids[-1:]), sequence
        except BaseException:
            sequence.release()
            raise

    def _check_kv(self, kv: np.ndarray, tokens: int, prompt_tokens: int) -> None:
        """A KV from another server must be this model's, in its dtype, for this prompt's
        `tokens` tokens it was asked for (a prefill server running another model would
        otherwise fail the whole batch's step)."""
        if kv.dtype != self.wire_type:
            raise InvalidRequest(
                f"the KV is {kv_dtype_name(kv)}; this server's model runs in {self.dtype_name} "
                f"(prefill and decode servers must run the model in one dtype: {DTYPE.names})"
            )
        if tuple(kv.shape) != self.kv_shape(tokens):
            raise InvalidRequest(
                f"the KV has shape {list(kv.shape)}; this model and {tokens} tokens of a {prompt_tokens}-token "
                f"prompt need {list(self.kv_shape(tokens))} (are prefill and decode serving the same model?)"
            )


class PromptPrefill:
    """A prompt's KV computed into a new sequence chunk by chunk, after the prefix the pool
    caches, so a long prompt can share the thread with other work between chunks.

    NOTE: the cached prefix is looked up at the first chunk, not at construction: a prompt
    admitted beside another of the same prefix (a burst of one conversation's turns, one
    system prompt's requests) reuses the blocks that one computed before this one's turn.
    The sequence (`sequence`) exists from construction on: a caller that abandons the
    prefill calls `release()`."""

    def __init__(self, engine: CausalLM, prompt_token_ids: list[int], cache_salt: str | None, chunk: int):
        engine.check_prompt(prompt_token_ids)
        engine.check_fits(len(prompt_token_ids))
        self.engine, self.prompt_token_ids, self.chunk = engine, prompt_token_ids, chunk
        self.sequence = engine.sequence(cache_salt)
        self._done: int | None = None  # prompt tokens in the sequence; None before the first chunk
        self._prefix_keys: list[int] | None = None  # before the first chunk, once asked for

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache gave (0 before the first chunk)."""
        return self.sequence.cached_tokens

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute; before the first chunk, after the prefix the pool
        caches now (the first chunk takes it, or what of it is still cached then)."""
        if self._done is not None:
            return len(self.prompt_token_ids) - self._done
        if self._prefix_keys is None:
            self._prefix_keys = self.sequence.prefix_keys(self.prompt_token_ids)
        pool = self.engine.pool
        return len(self.prompt_token_ids) - pool.cached_run(self._prefix_keys) * pool.block_tokens

    @property
    def uncached_block(self) -> int | None:
        """Before the first chunk, the prefix-cache key of the first block it would compute
        (None when it computes no full block, or after the first chunk): two prompts whose
        first chunks compute the same block compute it twice if they share a pass."""
        if self._done is not None or not self.engine.pool.prefix_caching:
            return None  # without a prefix cache, no pass after this one finds the block cached
        keys = self._prefix_keys = self._prefix_keys or self.sequence.prefix_keys(self.prompt_token_ids)
        cached = self.engine.pool.cached_run(keys)
        return keys[cached] if cached < len(keys) else None

    def next_chunk(self, greedy: bool = False) -> tuple[Sequence, list[int], bool]:
        """The next chunk, as CausalLM.prefill_chunks takes it (the cached prefix is taken at
        the first); `finish_chunk` after computing it."""
        if self._done is None:
            self._done = self.sequence.reuse_prefix(self.prompt_token_ids, self._prefix_keys)
        end = min(len(self.prompt_token_ids), self._done + self.chunk)
        last = end == len(self.prompt_token_ids)
        # Only the last chunk's head is used: the ones before it take no greedy screen.
        return self.sequence, self.prompt_token_ids[self._done : end], greedy and last

    def finish_chunk(
        self, computed: tuple[torch.Tensor | None, int | None]
    ) -> tuple[torch.Tensor | None, int | None] | None:
        """After the chunk `next_chunk` gave was computed (`computed`, its pair): None until
        the prompt is complete, then the logits after it and their argmax if greedy."""
        self._done = len(self.sequence)
        return computed if self._done == len(self.prompt_token_ids) else None

    def step(self, greedy: bool = False) -> tuple[torch.Tensor | None, int | None] | None:
        """Compute the next chunk alone; None until the prompt is complete, then the logits
        after it and, if `greedy`, their argmax (CausalLM.prefill_chunk_choosing's pair). A
        failure releases the sequence."""
        try:
            chunk = self.next_chunk(greedy)
            return self.finish_chunk(self.engine.prefill_chunk_choosing(*chunk))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        self.sequence.release()


class DecodeBatch:
    """The running sequences, stepped together: one forward pass per step, each row
    attending over its own blocks. A join or a leave moves no KV (a leaving row's
    blocks go back to the pool, its full ones staying cached)."""

    def __init__(self, engine: CausalLM):
        self.engine = engine
        self._sequences: list[Sequence] = []

    def __len__(self) -> int:
        return len(self._sequences)

    def kv_bytes(self) -> int:
        """Bytes of KV the pool's live sequences hold (this batch's and those still prefilling)."""
        return self.engine.kv_bytes_held()

    def join(self, sequence: Sequence) -> int:
        """Add a prefilled or imported sequence; return its row."""
        self._sequences.append(sequence)
        return len(self._sequences) - 1

    def leave(self, rows: list[int]) -> None:
        """Drop these rows (finished, cancelled or failed), giving their blocks back."""
        leaving = set(rows)
        for row in sorted(leaving):
            self._sequences[row].release()
        self._sequences = [s for row, s in enumerate(self._sequences) if row not in leaving]

    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Feed one token per row; the next token's logits per row, [rows, vocab]."""
        return self.engine.step(self._sequences, token_ids)

    def step_rows(self, token_ids: list[int], greedy: list[bool]) -> tuple[list[torch.Tensor | None], list[int | None]]:
        """Feed one token per row: each row's logits and greedy token (CausalLM.step_rows)."""
        return self.engine.step_rows(self._sequences, token_ids, greedy)

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each row's greedy token of a step's `logits`."""
        return self.engine.argmax(logits)


def _project_vocab_by_rows(model: torch.nn.Module) -> None:
    """Give a CPU model an output projection on RowGemm (core.generation.projection): MKL's
    fp32 GEMM in `nn.Linear`'s layout made the projection most of a decode step. `bench
    batching --step-only` times the step with it and with transformers' `nn.Linear` side by
    side."""
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:
        model.set_output_embeddings(_VocabProjection(head))


class _VocabProjection(torch.nn.Module):
    """nn.Linear's result by RowGemm (the weight is shared with tied input embeddings): its
    blocked layout made on the first pass, not at load."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.gemm = RowGemm(linear.weight, lazy=True, transposed_for_one_row=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.gemm(hidden)
        return out if self.bias is None else out + self.bias
