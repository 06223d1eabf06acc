"""Where a drafter's head forwards run: the head's own preallocated slots, each forward's inputs in one buffer, and,
on a card, one captured CUDA graph per shape.

A head forward is small (one decoder layer and an output matrix over the draft vocabulary), so on a card its
launches, not its arithmetic, are its cost: an eager forward is a few dozen kernel launches, and a drafted step
makes one forward per tree level. `HeadRunner.read` makes each forward one host-to-device copy of its inputs and
one graph replay:

- **Slots.** The head's keys and values live in `HeadSlots` of a fixed capacity (rounded up to `LENGTH_STEP`);
  the caller names the slot each new position writes and which slots each may see. A longer text makes a larger
  cache, and its graphs are captured again.
- **Rows padded to a few counts** (`ROWS`): padding rows come first, write into the last `SCRATCH` slots and see
  only their own slot; the real rows are the last ones. More rows than the largest count are read in chunks.
- **The draft distribution inside the forward**: each real row's `topk` most probable draft tokens (as target
  ids) and their probabilities, or only the last row's (`last_only`: reading the committed text, whose last
  position alone drafts).

Without a card the same forward runs eagerly on the same slots, unpadded (in the same chunks); where a capture
fails, eagerly and padded.

Example (a random head over a tiny target: read 3 committed positions, then one level of 2 drafted nodes):
    >>> runner = HeadRunner(head, topk=4, capture=False)                            # doctest: +SKIP
    >>> runner.reserve(keep=0, length=8)                                            # doctest: +SKIP
    >>> first = runner.read([5, 6, 7], [0, 1, 2], [0, 1, 2], [(1, []), (2, []), (3, [])], features, True)
    ...                                                                             # doctest: +SKIP
    >>> first.out.shape, first.ids.shape                # the last row's output and its 4 guesses  # doctest: +SKIP
    (torch.Size([1, 64]), torch.Size([1, 4]))
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from forerun.base.bucket_steps import graph_of
from forerun.drafters.eagle3.head import Eagle3Head, HeadSlots

logger = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32, 64)
"""Row counts a captured head forward is padded to."""
SCRATCH = ROWS[-1]
"""Slots at the end of the cache that padding rows write into (seen by no real row)."""
LENGTH_STEP = 512
"""The slots' capacity is rounded up to a multiple of this."""
INPUTS = 3
"""Leading columns of a row's inputs: token, position, slot; its visibility over every slot follows."""

Visibility = tuple[int, list[int]]
"""What one row sees: every slot below a count (the committed text it reads after), and these slots besides."""


def slots_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The head's keys and values on a CPU in fp32 under a half-precision head: its attention then runs PyTorch's
    fp32 CPU kernel, which for one query costs a fraction of the bf16 one (as the target's, `forerun.attention`;
    measured on the shipped head: one query over 256 slots 513 us a call in bf16, its whole forward 1.6 ms). Only
    its queries are cast; what it guesses moves a little, what is written never does.

        >>> slots_dtype(torch.bfloat16, torch.device("cpu")), slots_dtype(torch.bfloat16, torch.device("meta"))
        (torch.float32, torch.bfloat16)
    """
    half = dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if half and device.type == "cpu" else dtype


@dataclass(frozen=True)
class HeadRead:
    """One read's outputs: `out` [n, H] (only the last row's, [1, H], for `last_only`), and for the same rows the
    `topk` most probable draft tokens as target ids `ids` [n, topk] with their probabilities `probs` [n, topk]."""

    out: torch.Tensor
    probs: torch.Tensor
    ids: torch.Tensor


@dataclass
class HeadGraph:
    """A captured forward: its input buffer (device), the pinned host twin, its hidden-state input, and the outputs
    every replay rewrites."""

    inputs: torch.Tensor
    host: torch.Tensor
    hidden: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class HeadRunner:
    """Runs `head`'s forwards on its own slots (module docstring); `capture`: as CUDA graphs where the head is on a
    card. `pad`: rows padded to `ROWS` even without graphs (None: where captured; the tests' check of the
    padding on a CPU)."""

    def __init__(self, head: Eagle3Head, topk: int, capture: bool = True, pad: bool | None = None) -> None:
        self.head, self.topk = head, min(topk, head.config.draft_vocab_size)
        weight = head.fc.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.capture = capture and self.device.type == "cuda"
        self.pad = self.capture if pad is None else pad
        self.slots: HeadSlots | None = None
        self.graphs: dict[tuple[int, bool, bool], HeadGraph] = {}

    def reserve(self, keep: int, length: int) -> None:
        """Room for `length` slots; a larger cache keeps the first `keep` slots' entries (and captures anew)."""
        if self.slots is not None and length + SCRATCH <= self.slots.capacity:
            return
        attention = self.head.midlayer.self_attn
        capacity = -(-(length + SCRATCH) // LENGTH_STEP) * LENGTH_STEP
        grown = HeadSlots(attention.kv_heads, attention.head_dim, capacity, slots_dtype(self.dtype, self.device),
                          self.device)  # fmt: skip
        if self.slots is not None and keep:
            grown.keys[:, :keep], grown.values[:, :keep] = self.slots.keys[:, :keep], self.slots.values[:, :keep]
        self.slots, self.graphs = grown, {}

    def read(self, tokens: list[int], positions: list[int], slots: list[int], visible: list[Visibility],
             hidden: torch.Tensor, project: bool, last_only: bool = False) -> HeadRead:  # fmt: skip
        """A forward of len(tokens) rows: row i reads token `tokens[i]` at head position `positions[i]` with the
        hidden state `hidden[i]` (the target's features [n, 3 Ht] when `project`, else the head's own outputs
        [n, H]), writes slot `slots[i]` and sees what `visible[i]` names. Chunked by the largest row count; a
        later chunk sees what an earlier one wrote."""
        if not tokens:
            raise ValueError("a head forward needs at least one row")
        for start in range(0, len(tokens), ROWS[-1]):
            part = slice(start, start + ROWS[-1])
            done = self.read_rows(tokens[part], positions[part], slots[part], visible[part],
                                  hidden[part], project, last_only)  # fmt: skip
        return done

    def read_rows(self, tokens, positions, slots, visible, hidden, project, last_only) -> HeadRead:
        """`read` of at most the largest row count: padded and replayed, or eagerly (padded where `pad`)."""
        n = len(tokens)
        rows = next(r for r in ROWS if r >= n) if self.pad else n
        host = self.inputs_of(tokens, positions, slots, visible, rows)
        graph = self.graph(rows, project, last_only) if self.capture else None
        if graph is None:
            padded = hidden.to(self.dtype)
            if rows > n:
                padded = torch.cat([padded.new_zeros(rows - n, padded.shape[1]), padded])
            out, probs, ids = self.forward(torch.from_numpy(host).to(self.device), padded, project, last_only)
        else:
            graph.host.numpy()[:] = host
            graph.inputs.copy_(graph.host)
            graph.hidden[rows - n :].copy_(hidden)
            graph.graph.replay()
            out, probs, ids = graph.outputs
        if last_only:
            return HeadRead(out[-1:], probs, ids)
        return HeadRead(out[rows - n :], probs[rows - n :], ids[rows - n :])

    def inputs_of(self, tokens, positions, slots, visible, rows: int) -> np.ndarray:
        """[rows, INPUTS + capacity] int64: padding rows first (a scratch slot each, seeing only it), then the real
        rows' token, position, slot and a 1 at every slot they see."""
        capacity = self.slots.capacity
        host = np.zeros((rows, INPUTS + capacity), dtype=np.int64)
        pad = rows - len(tokens)
        scratch = capacity - SCRATCH + np.arange(pad)
        host[:pad, 2] = scratch
        host[np.arange(pad), INPUTS + scratch] = 1
        host[pad:, 0], host[pad:, 1], host[pad:, 2] = tokens, positions, slots
        for row, (below, seen) in enumerate(visible, start=pad):
            host[row, INPUTS : INPUTS + below] = 1
            host[row, [INPUTS + slot for slot in seen]] = 1
        return host

    def forward(self, inputs: torch.Tensor, hidden: torch.Tensor, project: bool, last_only: bool):
        """The forward a graph captures: inputs [R, INPUTS + capacity], hidden [R, F] -> out [R, H] and the top
        draft tokens of every row (or the last)."""
        self.slots.where = inputs[:, 2]
        g = self.head.project(hidden) if project else hidden
        out = self.head(inputs[:, 0], g, inputs[:, 1], self.slots, inputs[:, INPUTS:] != 0)
        probs = torch.softmax(self.head.draft_logits(out[-1:] if last_only else out).float(), dim=-1)
        top = probs.topk(self.topk, dim=-1)
        return out, top.values, self.head.target_ids(top.indices)

    def graph(self, rows: int, project: bool, last_only: bool) -> HeadGraph | None:
        """The captured forward of `rows` rows of this kind, captured at first use; None where it cannot be
        (then every forward runs eagerly)."""
        key = (rows, project, last_only)
        if key not in self.graphs:
            width = self.head.fc.in_features if project else self.head.config.hidden_size
            host = torch.from_numpy(self.inputs_of([], [], [], [], rows)).pin_memory()
            made = HeadGraph(host.to(self.device), host,
                             torch.zeros(rows, width, dtype=self.dtype, device=self.device))  # fmt: skip
            try:
                made.graph, made.outputs = graph_of(
                    lambda: self.forward(made.inputs, made.hidden, project, last_only), self.device
                )
            except RuntimeError as error:
                logger.warning("an EAGLE-3 head's forward could not be captured; it runs eagerly: %s", error)
                self.capture = False
                return None
            self.graphs[key] = made
        return self.graphs[key]

    def warm(self, length: int, width: int) -> None:
        """Capture now every graph a text of `length` slots asks for (levels of up to `width` nodes)."""
        self.reserve(0, length)
        for rows in ROWS:
            if self.capture:
                self.graph(rows, True, True)
            if self.capture and rows < 2 * width:
                self.graph(rows, False, False)
