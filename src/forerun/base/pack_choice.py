"""Whether this CPU multiplies a model's dense layers faster laid out for oneDNN (`forerun.base.packed`) than as
transformers computes them: measured once, not assumed from the CPU's vector units.

Laid out, a small model's forward measured faster on an AVX-512 EPYC in fp32 and bf16, but on an Intel Xeon with AMX
only in bf16: there an fp32 1-token forward cost more laid out, and plain generate slowed (docs/benchmarks.md). So
`load_model` lays weights out only where one row passed through them, the product of every undrafted step and of
plain generate, measured no slower laid out than dense. The layers are laid out beside the model (a probe holding
the model's own layers, then copies of them laid out and stacked as `pack_weights` does, with their row table), the
two passes timed in turn, and the probe let go: the model itself is not touched.

The probe holds whole modules' layers (siblings stay together, so they stack as in the model), module by module as
`named_modules` visits them (the output matrix last), up to `PROBE_BYTES` of weights: enough to read them from
memory rather than from a cache, as a forward does, while the laid-out copies add at most that much memory for the
few seconds of measuring. The answer is kept under `~/.cache/forerun/packed-choice/`, per layer shapes, dtype, CPU,
thread count and torch version.

Example (a model of two small layers; the answer depends on this CPU):
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    >>> [name for name, _ in probe_layers(model)], pack_pays(model, cache_dir=None) in (True, False)
    (['0', '1'], True)
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from forerun.base.packed import lay_out_rows, layable, pack_weights, read_by_hand
from forerun.measured import DEFAULT_CACHE_DIR, fastest, kept_answer, layers_measured

PROBE_BYTES = 1 << 30
"""The most weight bytes the probe holds (its laid-out copies as many again, while measuring)."""
REPEATS = 5
VERSION = 1
LAYOUTS = ("dense", "laid out")


def probe_layers(model: torch.nn.Module, budget: int = PROBE_BYTES) -> list[tuple[str, torch.nn.Linear]]:
    """(qualified name, layer) of the layers `pack_weights` would lay out, each module's together, modules taken
    as `named_modules` visits them, the root's own (an output matrix) last, while their weights fit in `budget`
    bytes (at least one module): the repeated blocks first, the bulk of a large model's weights."""
    by_hand, groups = read_by_hand(model), []
    for parent_name, parent in model.named_modules():
        layers = [(name, child) for name, child in parent.named_children() if layable(child, by_hand)]
        if layers:
            groups.append([(f"{parent_name}.{name}" if parent_name else name, layer) for name, layer in layers])
    groups.sort(key=lambda group: "." not in group[0][0])  # stable: the root's own layers (no dot) after the rest
    taken, size = [], 0
    for group in groups:
        weight = sum(layer.weight.numel() * layer.weight.element_size() for _, layer in group)
        if taken and size + weight > budget:
            break
        taken, size = taken + group, size + weight
    return taken


def pack_pays(model: torch.nn.Module, cache_dir: Path | str | None = DEFAULT_CACHE_DIR) -> bool:
    """Whether `model`'s dense layers pass one row through faster laid out (or as fast): read from `cache_dir`,
    else measured now (`time_layouts`, a second or two for a small model) and stored there (None: measured,
    nothing read or written). False where no layer can be laid out."""
    probe = probe_layers(model)
    if not probe:
        return False
    shapes = [[layer.out_features, layer.in_features, layer.bias is not None] for _, layer in probe]
    settings, path = layers_measured("packed-choice", probe[0][1].weight, shapes, VERSION, cache_dir)

    def measure() -> tuple[bool, dict]:
        seconds = time_layouts(probe, cache_dir)
        return seconds["laid out"] <= seconds["dense"], {"ms": {layout: s * 1e3 for layout, s in seconds.items()}}

    return kept_answer(path, settings, "pack", lambda answer: isinstance(answer, bool), measure)


@torch.inference_mode()
def time_layouts(
    probe: list[tuple[str, torch.nn.Linear]], cache_dir: Path | str | None = DEFAULT_CACHE_DIR
) -> dict[str, float]:
    """Seconds of one pass of one row through the `probe`'s layers, per layout: "dense" (the layers as they are)
    and "laid out" (copies laid out, stacked and given their row table as `load_model` would; siblings fed one
    input, as a forward feeds them). The fastest of `REPEATS` interleaved rounds (`measured.fastest`)."""
    stand_ins: dict[str, torch.nn.Module] = {}  # per parent module, its probed layers under their own names
    for qualified, layer in probe:
        parent, _, name = qualified.rpartition(".")
        stand_ins.setdefault(parent, torch.nn.Module()).add_module(name, layer)
    # in the probe's order, the model's own (its output matrix after its blocks): a whole model's products come in
    # the order they do in the model, so the row table measured here is the one `load_model` then reads
    holder = torch.nn.ModuleList(stand_ins.values())
    pack_weights(holder)  # the stand-ins get laid-out copies; the model keeps its own layers
    lay_out_rows(holder, cache_dir)
    laid = [getattr(stand_ins[parent], name) for parent, _, name in (q.rpartition(".") for q, _ in probe)]
    weight = probe[0][1].weight
    inputs = {width: torch.randn(1, 1, width, generator=torch.Generator().manual_seed(width)).to(weight.dtype)
              for width in {layer.in_features for _, layer in probe}}  # fmt: skip
    layers = {"dense": [layer for _, layer in probe], "laid out": laid}

    def seconds_of(layout: str) -> float:
        started = time.perf_counter()
        for layer in layers[layout]:
            layer(inputs[layer.in_features])
        return time.perf_counter() - started

    what = f"timing {len(probe)} layers dense and laid out (once per machine and threads)"
    return fastest(LAYOUTS, seconds_of, REPEATS, what)
