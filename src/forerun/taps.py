"""The target's hidden states at a few decoder layers, read off the verification forward itself.

A drafter that drafts from the target's features (an EAGLE-3 head reads three layers' outputs) declares
`feature_layers`; the step loop then hangs forward hooks (PyTorch's own, removed when the request ends) on those
layers and hands each step's drafters the features of the positions it committed. No extra forward of the target,
nothing in the model changed.

Example:
    >>> with LayerTaps(model, (1, 14, 26)) as taps:                     # doctest: +SKIP
    ...     logits = model(input_ids).logits
    ...     features = taps.take()                                      # [rows, n, 3 * hidden]
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

import torch


def feature_layers(drafters: Iterable[object]) -> tuple[int, ...]:
    """The layers some drafter reads (each drafter's `feature_layers`, in its order; the first that asks wins)."""
    for drafter in drafters:
        layers = tuple(getattr(drafter, "feature_layers", ()) or ())
        if layers:
            return layers
    return ()


class LayerTaps:
    """Forward hooks on decoder layers `layers` of `model`: `take()` gives the last forward's outputs of those
    layers, concatenated in that order, [rows, n, len(layers) * hidden] (None when no forward ran since, or no
    layers are asked for: then it hooks nothing).

    `read`: the layers the base's forwards return themselves (its `features`). Where they are these very layers,
    nothing is hooked and `take` hands back what the forward returned: a static base's graph runs no hook when it
    replays, so it reads them inside the graph."""

    def __init__(self, model: torch.nn.Module, layers: Sequence[int], read: Sequence[int] = ()) -> None:
        self.read_by_base = bool(layers) and tuple(layers) == tuple(read)
        layers = () if self.read_by_base else layers
        decoder = model.get_decoder() if layers and hasattr(model, "get_decoder") else None
        blocks = getattr(decoder, "layers", None)
        if layers and (blocks is None or not all(0 <= i < len(blocks) for i in layers)):
            raise ValueError(f"{type(model).__name__} has no decoder layers {list(layers)} to read hidden states from")
        self.blocks = [blocks[i] for i in layers] if layers else []
        self.outputs: list[torch.Tensor | None] = [None] * len(layers)
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.thread = threading.get_ident()

    def __enter__(self) -> LayerTaps:
        self.thread = threading.get_ident()  # the request's forwards run in the thread that decodes it
        for index, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_hook(self.keeper(index)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def keeper(self, index: int):
        def keep(module, args, output) -> None:
            # Another thread may run the same model meanwhile (another Decoder, plain generate): its forwards
            # run these hooks too, and their hidden states are not this request's.
            if threading.get_ident() == self.thread:
                self.outputs[index] = output[0] if isinstance(output, tuple) else output

        return keep

    def take(
        self, returned: torch.Tensor | None = None, arrange: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """The last forward's features [rows, n, len(layers) * hidden], or None; forgets them. `returned`: the
        features that forward returned (taken where the base read these layers); `arrange`: applied to the hooks'
        (a batch's rows in row order)."""
        if self.read_by_base:
            return returned
        if not self.outputs or any(output is None for output in self.outputs):
            return None
        features = torch.cat(self.outputs, dim=-1)  # type: ignore[arg-type]
        self.outputs = [None] * len(self.outputs)
        return features if arrange is None else arrange(features)


def committed_features(features: torch.Tensor | None, lead: int, kept: list[int]) -> torch.Tensor | None:
    """Of one row's tapped features [1, lead + nodes, F]: the lead's and the kept nodes' rows, [lead + kept, F]
    (None where nothing was tapped: a base whose forward is a replayed graph, or no drafter asked).

    Example (a lead of 2 prompt tokens, then a tree whose nodes 0 and 2 were kept):
        >>> committed_features(torch.arange(5.0)[None, :, None], 2, [0, 2]).flatten().tolist()
        [0.0, 1.0, 2.0, 4.0]
    """
    if features is None or features.shape[0] != 1 or lead + max(kept) >= features.shape[1]:
        return None  # the last of several forwards (a prompt fed in chunks) holds only the prompt's tail
    rows = torch.tensor(list(range(lead)) + [lead + node for node in kept], device=features.device)
    return features[0].index_select(0, rows)


def row_features(
    tapped: torch.Tensor | None, b: int, nodes: int, layers: tuple[int, ...], drafters: Iterable[object]
) -> torch.Tensor | None:
    """Row `b`'s tapped features [1, nodes, F] of the batch's [rows, padded nodes, F], for a row whose drafters read
    those very `layers` (None for the others: a head that reads other layers is handed nothing)."""
    if tapped is None or feature_layers(drafters) != layers:
        return None
    return tapped[b : b + 1, :nodes]
