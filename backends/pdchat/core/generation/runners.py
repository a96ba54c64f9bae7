"""How CausalLM computes a pass: one runner, chosen when the engine loads.

A runner turns a pass's input ids [rows, queries] and its paged view into each row's
logits after its last query and, for the rows marked greedy, their greedy token. Three
runners, each a superset of the one before:

- `TransformersRunner`: transformers' forward with pdchat's paged attention, for every model;
- `OwnForwardRunner`: pdchat's own Llama forward (core.generation.llama), for the models
  it computes exactly (`llama.supports`);
- `GreedyHeadRunner`: the own forward, with greedy rows' tokens decided by the C kernels'
  GreedyHead straight from the hidden state (core.generation.cpu_kernels).

`kernels` (the C kernels, or None) go to every pass's PagedForward and decide the argmax;
they are part of the runner, not looked up per pass. CausalLM.path names what its runner
runs (core.engine_api.ExecutionPath), for the startup log and the `pdchat_engine_info` metric.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from pdchat.core.generation.cpu_kernels import DecodeKernels, GreedyHead
from pdchat.core.generation.paged import PagedForward, PromptSegments

if TYPE_CHECKING:
    from pdchat.core.generation.llama import LlamaForward


class Runner(Protocol):
    """What CausalLM calls per pass (TransformersRunner documents each method)."""

    kernels: DecodeKernels | None

    def last_logits(self, input_ids: torch.Tensor, paged: PagedForward) -> torch.Tensor: ...

    def project_last(
        self, input_ids: torch.Tensor, paged: PagedForward, greedy: list[bool]
    ) -> tuple[list[torch.Tensor | None], list[int | None]]: ...

    def argmax(self, logits: torch.Tensor) -> list[int]: ...


class TransformersRunner:
    """transformers' forward; greedy tokens are the argmax of the logits."""

    def __init__(self, model: torch.nn.Module, kernels: DecodeKernels | None):
        self.model = model
        self.kernels = kernels

    def last_logits(self, input_ids: torch.Tensor, paged: PagedForward) -> torch.Tensor:
        """One pass over `input_ids` [rows, queries]; the logits after each row's last, [rows, vocab]."""
        # logits_to_keep=1: a prompt's logits at every position would be vocab x tokens floats for nothing.
        out = self.model(
            input_ids=input_ids, position_ids=paged.query_positions, use_cache=False, logits_to_keep=1, paged=paged
        )
        return out.logits[:, -1].float()

    def project_last(
        self, input_ids: torch.Tensor, paged: PagedForward, greedy: list[bool]
    ) -> tuple[list[torch.Tensor | None], list[int | None]]:
        """One pass over `input_ids` [rows, queries]; per row, the logits after its last query
        (None where a greedy row's token was decided without them) and, for rows marked
        `greedy`, the greedy token (None for the others)."""
        return self._pair(self.last_logits(input_ids, paged), greedy)

    def _pair(self, logits: torch.Tensor, greedy: list[bool]) -> tuple[list[torch.Tensor | None], list[int | None]]:
        """project_last's pair from the rows' logits [rows, vocab]."""
        chosen: list[int | None] = self.argmax(logits) if any(greedy) else [None] * len(greedy)
        return list(logits), chosen

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each row's greedy token of `logits` [rows, vocab] (the first on a tie)."""
        if self.kernels is not None and logits.dtype == torch.float32 and logits.is_contiguous():
            return self.kernels.argmax(logits)
        return logits.argmax(-1).tolist()


class OwnForwardRunner(TransformersRunner):
    """pdchat's own Llama forward (`forward`), then the model's vocabulary projection."""

    def __init__(self, model: torch.nn.Module, kernels: DecodeKernels | None, forward: LlamaForward):
        super().__init__(model, kernels)
        self.forward = forward
        self.projection = model.get_output_embeddings()

    def last_logits(self, input_ids: torch.Tensor, paged: PagedForward) -> torch.Tensor:
        hidden = self.forward(input_ids, paged, last_only=True)
        return self.projection(hidden)[:, -1].float()

    def project_last(
        self, input_ids: torch.Tensor, paged: PagedForward | PromptSegments, greedy: list[bool]
    ) -> tuple[list[torch.Tensor | None], list[int | None]]:
        """TransformersRunner.project_last, also for a pass of several prompts' chunks
        (PromptSegments: a row per chunk). NOTE: those rows are decided one at a time, as a
        prompt's alone: the GreedyHead's timings by row count (a pass's time each) are for
        decode's batches, and a prefill process never makes them."""
        hidden = self.forward(input_ids, paged, last_only=True)[:, -1]
        if not isinstance(paged, PromptSegments):
            return self._decide(hidden, greedy)
        rows: list[torch.Tensor | None] = []
        chosen: list[int | None] = []
        for row, wanted in enumerate(greedy):
            logits, token = self._decide(hidden[row : row + 1], [wanted])
            rows += logits
            chosen += token
        return rows, chosen

    def _decide(self, hidden: torch.Tensor, greedy: list[bool]) -> tuple[list[torch.Tensor | None], list[int | None]]:
        """project_last's pair from the rows' final hidden states [rows, hidden]."""
        return self._pair(self.projection(hidden).float(), greedy)


class GreedyHeadRunner(OwnForwardRunner):
    """The own forward; a pass with greedy rows decides their tokens by `head` from the hidden
    state, and projects in full only the rows that sample and the greedy rows the head left
    undecided (those then take the exact argmax of their logits)."""

    def __init__(self, model: torch.nn.Module, kernels: DecodeKernels, forward: LlamaForward, head: GreedyHead):
        super().__init__(model, kernels, forward)
        self.head = head

    def _decide(self, hidden: torch.Tensor, greedy: list[bool]) -> tuple[list[torch.Tensor | None], list[int | None]]:
        if not any(greedy):
            return super()._decide(hidden, greedy)
        chosen: list[int | None] = [None] * len(greedy)
        rows: list[torch.Tensor | None] = [None] * len(greedy)
        greedy_rows = [row for row, wanted in enumerate(greedy) if wanted]
        for row, token in zip(greedy_rows, self.head.argmax(hidden[greedy_rows]), strict=True):
            chosen[row] = token if token >= 0 else None
        full = [row for row in range(len(greedy)) if not greedy[row] or chosen[row] is None]
        if full:  # rows that sample, and greedy rows the screen left undecided
            logits = self.projection(hidden[full]).float()
            undecided = [index for index, row in enumerate(full) if greedy[row]]
            tokens = self.argmax(logits[undecided].contiguous()) if undecided else []
            for index, token in zip(undecided, tokens, strict=True):
                chosen[full[index]] = token
            for index, row in enumerate(full):
                rows[row] = logits[index]
        return rows, chosen
