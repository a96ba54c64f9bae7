"""A lean forward pass for Llama-architecture models over the block pool: Llama, and the
families that are Llama with biases on q, k and v (Qwen2) or RMSNorms on each head's query
and key before the rotary (Qwen3).

transformers' forward is general: per layer it calls a dozen modules through decorators
and output-capturing hooks, projects q, k and v (and gate and up) in separate GEMMs and
computes the rotary table on every pass. At decode's sizes (a few rows, one token each)
that overhead is a good part of a step, and it holds the GIL, which the stage's outbox
thread needs. This pass computes the same thing from the same weights: q, k and v in one
GEMM, gate and up in one, `rms_norm` in one op, the rotary table once at load.

NOTE: with `blocked_gemms` off, in fp32 on CPU its logits equal transformers' bit for bit for
passes of two tokens or more (tests/unit/test_llama_forward.py): the stacked weights are the
separate ones one after the other, the rotary table is transformers' own rotary module
evaluated at every position, and each op is the one transformers runs, in its order. A pass
of a single token agrees to rounding only: there torch multiplies by a vector, and that
kernel's sums depend on where the weight lies in memory (the loaded ones are not 64-byte
aligned, the stacks are). The model's projection modules are rebound to views of the
stacks, so memory is not doubled. With `blocked_gemms` on (the default), every pass
multiplies by oneDNN's blocked layout of each weight, which holds it once more, and agrees
to rounding, with the same greedy tokens; each row's result is then the same bits in any
batch (core.generation.projection's batch invariance).

Decode's passes (one token per row) with the C kernels (`PagedForward.decode_kernels`,
core.generation.cpu_kernels) run everything between the GEMMs in C: per layer four GEMMs
and four kernel calls (RMSNorm with the residual add before it, rotary with the KV store,
attention, SwiGLU) instead of some forty torch ops. Passes of a prompt's tokens with the
kernels take the row-wise ones (the RMSNorms with their residual adds, SwiGLU), rotary with
the KV store, and on AVX-512 their attention. Equal to the torch path to rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional

from pdchat.core.generation.cpu_kernels import DecodeKernels
from pdchat.core.generation.paged import PagedForward, PromptSegments, paged_attention, read_slots
from pdchat.core.generation.projection import RowGemm

# Rope types whose table does not depend on the sequence length (no dynamic scaling).
_STATIC_ROPE = frozenset({"default", "linear", "llama3"})
# The families this pass computes: Llama's decoder, Qwen2's (q, k and v biases), Qwen3's
# (per-head q and k RMSNorms); each without a sliding window.
FAMILIES = frozenset({"llama", "qwen2", "qwen3"})


def supports(model: torch.nn.Module) -> bool:
    """Whether `model` is a causal LM of FAMILIES this pass computes exactly: fp32, SiLU MLP,
    a rotary table fixed at load, full attention in every layer, no bias but on q, k and v,
    every projection a plain nn.Linear (not quantized)."""
    config = model.config
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    return (
        config.model_type in FAMILIES
        and getattr(config, "quantization_config", None) is None
        and model.dtype == torch.float32
        and config.hidden_act == "silu"
        and not getattr(config, "use_sliding_window", False)
        and all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ())
        and getattr(config, "pretraining_tp", 1) == 1
        and rope in _STATIC_ROPE
        and all(_plain(layer) for layer in model.model.layers)
    )


def _plain(layer: torch.nn.Module) -> bool:
    attention, mlp = layer.self_attn, layer.mlp
    qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
    projections = (*qkv, attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return (
        all(
            type(linear) is torch.nn.Linear
            and type(linear.weight.data) is torch.Tensor
            and linear.weight.dtype == torch.float32
            for linear in projections
        )
        and len({linear.bias is None for linear in qkv}) == 1
        and all(linear.bias is None for linear in projections[3:])
    )


class _Layer:
    """One decoder layer's weights, q/k/v and gate/up stacked, each projection a RowGemm."""

    def __init__(self, layer: torch.nn.Module, blocked: bool):
        attention, mlp = layer.self_attn, layer.mlp
        self.module = attention  # paged_attention reads its layer_idx
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
        bias = None if attention.q_proj.bias is None else torch.cat([linear.bias.detach() for linear in qkv])
        self.qkv = RowGemm(_stack(*qkv), bias=bias, blocked=blocked)  # Qwen2's biases
        # Qwen3's per-head RMSNorm weights, [heads, head_dim], the q heads' then the k heads'.
        self.head_norms = None
        if getattr(attention, "q_norm", None) is not None:
            q_heads = attention.config.num_attention_heads
            kv_heads = attention.config.num_key_value_heads
            self.head_norms = torch.cat(
                (
                    attention.q_norm.weight.detach().expand(q_heads, -1),
                    attention.k_norm.weight.detach().expand(kv_heads, -1),
                )
            ).contiguous()
        self.out = RowGemm(attention.o_proj.weight, blocked=blocked)
        self.gate_up = RowGemm(_stack(mlp.gate_proj, mlp.up_proj), blocked=blocked)
        self.down = RowGemm(mlp.down_proj.weight, blocked=blocked)


def _stack(*linears: torch.nn.Linear) -> torch.Tensor:
    """The linears' weights stacked into one, each linear rebound to its rows (a view)."""
    stacked = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = torch.nn.Parameter(stacked[start : start + rows], requires_grad=False)
        start += rows
    return stacked


class LlamaForward:
    """The decoder of a model `supports` accepts, over the block pool. `blocked_gemms`: its
    projections of more than one row by oneDNN over blocked weights on CPU
    (core.generation.projection); off, every GEMM is torch's on the plain weight, as in
    transformers."""

    def __init__(self, model: torch.nn.Module, blocked_gemms: bool = True):
        config, decoder = model.config, model.model
        self.embedding = decoder.embed_tokens.weight
        self.eps = config.rms_norm_eps
        self.q_heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.q_heads
        self.intermediate = config.intermediate_size
        self.scaling = self.head_dim**-0.5
        self.layers = [_Layer(layer, blocked_gemms) for layer in decoder.layers[: config.num_hidden_layers]]
        self.final_norm = decoder.norm.weight
        positions = torch.arange(config.max_position_embeddings, device=self.embedding.device).view(1, -1)
        with torch.inference_mode():
            cos, sin = decoder.rotary_emb(self.embedding, positions)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [positions, head_dim]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, paged: PagedForward | PromptSegments, last_only: bool) -> torch.Tensor:
        """The final hidden states of `input_ids` [rows, queries] at `paged.query_positions`,
        their KV written to the pool: [rows, queries, hidden], or [rows, 1, hidden] of each
        row's last query when `last_only`. With PromptSegments, `input_ids` is [1, tokens],
        the chunks one after another, and only `last_only` is served: [chunks, 1, hidden],
        each chunk's last token's."""
        rows, queries = input_ids.shape
        kernels = paged.decode_kernels  # prompts take the row-wise ones (norms, SwiGLU, rotary and KV store)
        if isinstance(paged, PromptSegments):
            if not last_only:
                raise ValueError("a pass of several prompts' chunks gives each chunk's last hidden state only")
            attend = self._segments_attention(paged, kernels)
        else:
            attend = self._attention(paged, kernels, rows, queries)
        hidden = functional.embedding(input_ids.reshape(-1), self.embedding)  # the residual stream, added into
        normed = self._rms_norm(kernels, hidden, self.layers[0].input_norm)
        prompt = queries > 1  # its GEMMs' rows bucketed (RowGemm): few shapes for all prompt lengths
        for index, layer in enumerate(self.layers):
            qkv = self._head_normed(layer, layer.qkv(normed, bucket_rows=prompt))
            attended = attend(layer, qkv)  # [rows * queries, q_heads * head_dim]
            delta = layer.out(attended, bucket_rows=prompt)
            normed = self._add_rms_norm(kernels, hidden, delta, layer.post_norm, normed)
            activated = self._swiglu(kernels, layer.gate_up(normed, bucket_rows=prompt))
            delta = layer.down(activated, bucket_rows=prompt)
            normed = self._add_rms_norm(kernels, hidden, delta, self._norm_after(index), normed)
        if isinstance(paged, PromptSegments):
            return normed[[end - 1 for _, end in paged.bounds()]].unsqueeze(1)
        out = normed.view(rows, queries, -1)
        return out[:, -1:] if last_only else out

    def _attention(self, paged: PagedForward, kernels: DecodeKernels | None, rows: int, queries: int) -> Callable:
        """The pass's attention per layer, qkv [rows * queries, ...] -> [rows * queries, q_heads * head_dim]."""
        if kernels is None:
            return self._attention_on_torch(paged, rows, queries)
        if queries == 1:
            return self._attention_in_c(paged, kernels, rows)
        return self._prompt_attention(paged, kernels, rows, queries)

    def _segments_attention(self, segments: PromptSegments, kernels: DecodeKernels | None) -> Callable:
        """Each chunk's attention over its own sequence, on its own tokens' q, k and v."""
        parts = [
            (start, end, self._attention(part, kernels, 1, end - start))
            for (start, end), part in zip(segments.bounds(), segments.parts, strict=True)
        ]

        def attend(layer: _Layer, qkv: torch.Tensor) -> torch.Tensor:
            return torch.cat([chunk(layer, qkv[start:end]) for start, end, chunk in parts])

        return attend

    def _attention_on_torch(self, paged: PagedForward, rows: int, queries: int) -> Callable:
        """Rotary on torch's ops, then the pool's attention (its KV store, SDPA), per layer."""
        cos = self.cos[paged.query_positions].unsqueeze(2)  # [rows, queries, 1, head_dim]
        sin = self.sin[paged.query_positions].unsqueeze(2)
        q_size, kv_size, half = self.q_heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim // 2

        def attend(layer: _Layer, qkv: torch.Tensor) -> torch.Tensor:
            qk = qkv[:, : q_size + kv_size].view(rows, queries, self.q_heads + self.kv_heads, self.head_dim)
            qk = (qk * cos) + (torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin)  # rotary
            value = qkv[:, q_size + kv_size :].view(rows, queries, self.kv_heads, self.head_dim)
            attended, _ = paged_attention(
                layer.module,
                qk[:, :, : self.q_heads].transpose(1, 2),
                qk[:, :, self.q_heads :].transpose(1, 2),
                value.transpose(1, 2),
                None,
                scaling=self.scaling,
                paged=paged,
            )
            return attended.reshape(rows * queries, -1)

        return attend

    def _attention_in_c(self, paged: PagedForward, kernels: DecodeKernels, rows: int) -> Callable:
        """One query per row: rotary with the KV store, then attention over the pool, in C."""
        positions, write, lengths = paged.query_positions.reshape(-1), paged.write.reshape(-1), paged.lengths()
        q_size = self.q_heads * self.head_dim

        def attend(layer: _Layer, qkv: torch.Tensor) -> torch.Tensor:
            keys, values = paged.pool.keys[layer.module.layer_idx], paged.pool.values[layer.module.layer_idx]
            kernels.rope_store(qkv, self.cos, self.sin, positions, write, keys, values, self.q_heads)
            query = qkv[:, :q_size].view(rows, self.q_heads, self.head_dim)
            return kernels.attention(query, keys, values, paged.read, lengths, self.scaling, None).view(rows, -1)

        return attend

    def _prompt_attention(self, paged: PagedForward, kernels: DecodeKernels, rows: int, queries: int) -> Callable:
        """A prompt's queries: rotary with the KV store in C (as a decode step's), then the
        kernels' prompt attention over the pool's slots for one prompt's chunk (AVX-512; its
        positions follow on from the columns before them), else SDPA over this pass's own
        keys and values where they are all the row attends over (`paged.causal`: no cached
        prefix), else over the pool's slots with the pass's mask.

        NOTE: the pool holds exactly the keys and values the C store wrote, so every kind of
        pass attends over the same numbers."""
        positions, write = paged.query_positions.reshape(-1), paged.write.reshape(-1)
        q_size, kv_size = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        in_c = self._chunk_columns(paged, kernels, rows, queries)

        def heads(flat: torch.Tensor, count: int) -> torch.Tensor:
            """[rows * queries, count * head_dim] -> [rows, count, queries, head_dim], a view."""
            return flat.view(rows, queries, count, self.head_dim).transpose(1, 2)

        def attend(layer: _Layer, qkv: torch.Tensor) -> torch.Tensor:
            keys, values = paged.pool.keys[layer.module.layer_idx], paged.pool.values[layer.module.layer_idx]
            kernels.rope_store(qkv, self.cos, self.sin, positions, write, keys, values, self.q_heads)
            if in_c is not None:
                query = qkv[:, :q_size].view(queries, self.q_heads, self.head_dim)
                return kernels.prompt_attention(query, keys, values, in_c, self.scaling).view(queries, -1)
            query = heads(qkv[:, :q_size], self.q_heads)
            if paged.causal:
                key, value = (
                    heads(qkv[:, q_size : q_size + kv_size], self.kv_heads),
                    heads(qkv[:, q_size + kv_size :], self.kv_heads),
                )
            else:
                key, value = read_slots(paged, keys), read_slots(paged, values)
            attended = paged.attend(query, key, value, self.scaling)
            return attended.transpose(1, 2).reshape(rows * queries, -1)

        return attend

    def _chunk_columns(
        self, paged: PagedForward, kernels: DecodeKernels, rows: int, queries: int
    ) -> torch.Tensor | None:
        """The pool slots of every position one prompt's chunk attends over, when the
        kernels' prompt attention takes it: one row whose queries are the positions right
        after the columns before them (a chunk, after a cached prefix or not). None: SDPA."""
        if rows != 1 or not kernels.takes_prompt_attention(self.head_dim):
            return None
        first, last = int(paged.query_positions[0, 0]), int(paged.query_positions[0, -1])
        if last - first + 1 != queries or paged.read.shape[1] <= last:
            return None
        return paged.read[0, : last + 1].contiguous()

    def _head_normed(self, layer: _Layer, qkv: torch.Tensor) -> torch.Tensor:
        """q, k and v with each query and key head RMSNormed where the family does (Qwen3),
        in place, before the rotary."""
        if layer.head_norms is not None:
            heads = layer.head_norms.shape[0]
            qk = qkv[:, : heads * self.head_dim].view(-1, heads, self.head_dim)
            qk.copy_(functional.rms_norm(qk, (self.head_dim,), None, self.eps) * layer.head_norms)
        return qkv

    def _norm_after(self, index: int) -> torch.Tensor:
        """The weight of the RMSNorm after layer `index`: the next layer's input norm, or the final one."""
        return self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm

    def _rms_norm(self, kernels: DecodeKernels | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if kernels is not None:
            return kernels.rms_norm(x, weight, self.eps)
        return functional.rms_norm(x, x.shape[-1:], weight, self.eps)

    def _add_rms_norm(
        self,
        kernels: DecodeKernels | None,
        hidden: torch.Tensor,
        delta: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """hidden += delta; RMSNorm(hidden) * weight (into `out` with the kernels)."""
        if kernels is not None:
            kernels.add_rms_norm(hidden, delta, weight, self.eps, out)
            return out
        hidden += delta
        return functional.rms_norm(hidden, hidden.shape[-1:], weight, self.eps)

    def _swiglu(self, kernels: DecodeKernels | None, gate_up: torch.Tensor) -> torch.Tensor:
        if kernels is not None:
            return kernels.silu_mul(gate_up)
        return functional.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
