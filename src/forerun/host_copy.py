"""A step's one copy to the host: every tensor of token ids it needs there, in a single transfer.

On a card a copy to the host waits for everything queued before it (the step's forward, the draws' kernels), so a
step that copied its argmaxes and then its draws would wait twice, and the host would sit idle between the two
while the card ran the draws. Here the base's argmaxes [rows, nodes] and every sampled row's draws [nodes] are
flattened into one tensor where they are and copied back together: one wait a step, after the card has run all of
it (`Batch.commit_rows`, `RowRun.on_host`).

Example:
    >>> to_host([torch.tensor([[4, 2], [1, 0]]), None, torch.tensor([7])])
    [[[4, 2], [1, 0]], None, [7]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Ids = list[int] | list[list[int]]


def to_host(tensors: Sequence[torch.Tensor | None]) -> list[Ids | None]:
    """Each of `tensors` (1-D or 2-D integer tensors on one device, or None) as host lists, as `.tolist()` gives
    them, in one transfer."""
    present = [tensor for tensor in tensors if tensor is not None]
    if not present:
        return [None] * len(tensors)
    flat = torch.cat([tensor.reshape(-1).long() for tensor in present]).tolist()
    out: list[Ids | None] = []
    at = 0
    for tensor in tensors:
        if tensor is None:
            out.append(None)
            continue
        part, at = flat[at : at + tensor.numel()], at + tensor.numel()
        if tensor.dim() == 2:
            width = tensor.shape[1]
            part = [part[r * width : (r + 1) * width] for r in range(tensor.shape[0])]
        out.append(part)
    return out
