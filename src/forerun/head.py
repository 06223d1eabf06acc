"""A forward's logits, with the output matrix applied in the layout this CPU computes fastest for a few positions.

A causal LM is a body (embeddings and layers, `model.model`) and an output matrix W [vocab, hidden] applied to the
body's last hidden states h [n, hidden]. Verifying a tree needs logits at each of its n nodes. The same product can
be written two ways, F.linear(h, W) and (W @ h^T)^T, and which is faster for a few rows depends on the CPU and its
BLAS: on one AVX-512 EPYC the tall product saved a sixth of a 2-token forward, on an AVX-512 Xeon it cost a fifth
(the timings per CPU are in docs/benchmarks.md). So the choice is measured, not assumed: once per matrix shape, dtype,
device, thread count and torch version, both layouts are timed at 1 to `TALL_MAX_POSITIONS` rows (a second or two,
`time_layouts`) and the result is kept under `~/.cache/forerun/head/`. A forward of n positions computes its
logits as (W @ h^T)^T where that measured at most `TALL_MARGIN` of F.linear's time at n; every other forward is the
model's own call.

One position is the commonest forward of all (every undrafted step), and there MKL's matrix-vector path can be the
slow one: the row is then written twice, [h; h], so the product runs as a matrix kernel on every thread, and the
first column is kept (`tall_product`).

The split is used only where it is the same computation: the first forward (the prefill) runs the whole model with
hooks on its body and its output matrix, and the split is taken from then on only if the model's logits were exactly
the output matrix applied to exactly the body's last hidden states (a bias-free `nn.Linear`): Gemma 2's logit
softcapping, Granite's logit scaling or MiniCPM's scaled hidden states keep the whole-model call. Only on a CPU in
fp32: in bf16 the matrix costs about the same for 1 to 4 rows, and GPU matrix kernels have no such small-row path.
The two layouts round differently (sums in another order: up to 1 unit in the last place); fp32 outputs stay
identical to plain generate, as the equality tests across the model families check.

Example:
    >>> head = LogitsHead(model)                                          # doctest: +SKIP
    >>> head(input_ids=prompt, cache=cache).shape                         # the prefill decides  # doctest: +SKIP
    torch.Size([1, 12, 49152])
    >>> sorted(head.tall_sizes)                                           # measured on this CPU  # doctest: +SKIP
    [7, 9, 10, 11, 12, 13, 14, 15, 16]
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Collection, Sequence
from pathlib import Path

import torch

from forerun.base.weights import dense
from forerun.forward_inputs import cache_argument
from forerun.measured import DEFAULT_CACHE_DIR, device_name, read_json, settings_digest, write_json

TALL_MAX_POSITIONS = 16
"""Most positions whose logits may be computed as (W @ h^T)^T: beyond, F.linear's large-matrix path is as fast on
both CPUs above."""
TALL_MARGIN = 0.9
"""The tall product is used at n rows only where it measured at most this share of F.linear's time: a layout that
merely ties keeps the model's own call."""
LAYOUTS_VERSION = 2
"""Part of a stored measurement's key: a measurement made by an older way is made again (2: one position too)."""


class LogitsHead:
    """Calls `model` for logits [rows, positions, vocab]; decides at its first call whether a tall product may
    replace the model's own output matrix for a few positions (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tall_sizes: Collection[int] | None = None,
        cache_dir: Path | str | None = DEFAULT_CACHE_DIR,
    ) -> None:
        """`tall_sizes`: the position counts to compute as a tall product (where the split is the model's own
        computation); None: those measured faster on this device (`tall_sizes_for`, stored under `cache_dir`;
        `cache_dir=None` measures without reading or writing a file)."""
        self.model = model
        self.cache_name = cache_argument(model) or "past_key_values"
        """What the model's forward calls its cache (`cache` from transformers 5.24 on): callers pass `cache=`."""
        self.keeps_logits = bool(last_logits(model, 1))
        self.decided = False
        self.body: torch.nn.Module | None = None
        """The model's body when the split was found equal to the model's own forward, else None."""
        self.weight: torch.Tensor | None = None
        """Its output matrix [vocab, hidden], with `body`."""
        self.requested = None if tall_sizes is None else frozenset(int(n) for n in tall_sizes)
        self.cache_dir = cache_dir
        self.tall_sizes: frozenset[int] = frozenset()
        """Position counts (1 to TALL_MAX_POSITIONS) whose logits this head computes as (W @ h^T)^T."""

    @property
    def tall(self) -> bool:
        """Whether some forwards compute their logits as (W @ h^T)^T."""
        return self.body is not None and bool(self.tall_sizes)

    def __call__(self, keep: int | None = None, **inputs: object) -> torch.Tensor:
        """The logits of one forward of `inputs` (the model's keyword arguments, `input_ids` [rows, n] among
        them; its cache as `cache`, whatever the installed transformers calls it): [rows, n, vocab], or the last
        `keep` positions' [rows, keep, vocab] where the model takes `logits_to_keep` (others return all n: callers
        take the last positions they need)."""
        kept = {"logits_to_keep": keep} if keep is not None and self.keeps_logits else {}
        if "cache" in inputs and self.cache_name != "cache":
            inputs[self.cache_name] = inputs.pop("cache")
        if not self.decided:
            return self.decide(inputs, kept)
        rows, n = inputs["input_ids"].shape  # type: ignore[union-attr]
        positions = min(keep, n) if kept else n
        if self.body is None or rows * positions not in self.tall_sizes:
            return self.model(**inputs, **kept).logits
        hidden = self.body(**inputs).last_hidden_state[:, n - positions :]  # [rows, positions, hidden]
        return tall_product(self.weight, hidden.reshape(rows * positions, -1)).view(rows, positions, -1)

    def decide(self, inputs: dict[str, object], kept: dict[str, int]) -> torch.Tensor:
        """Run the whole model once; keep its body for later calls if its logits were exactly the output matrix
        applied to exactly the body's output there."""
        self.decided = True
        model = self.model
        body = getattr(model, getattr(model, "base_model_prefix", ""), None)
        matrix = model.get_output_embeddings()
        parameter = next(model.parameters())
        eligible = (
            isinstance(body, torch.nn.Module)
            and body is not model
            and type(matrix) is torch.nn.Linear
            and matrix.bias is None
            and parameter.device.type == "cpu"
            and parameter.dtype == torch.float32
        )
        if not eligible:
            return model(**inputs, **kept).logits
        seen: dict[str, object] = {}

        def body_hook(module, args, output) -> None:
            seen["body"] = getattr(output, "last_hidden_state", None)

        def matrix_hook(module, args, kwargs, output) -> None:
            seen["matrix_in"] = args[0] if args else kwargs.get("input")
            seen["matrix_out"] = output

        hooks = [body.register_forward_hook(body_hook), matrix.register_forward_hook(matrix_hook, with_kwargs=True)]
        try:
            logits = model(**inputs, **kept).logits
        finally:
            for hook in hooks:
                hook.remove()
        hidden, matrix_in, matrix_out = seen.get("body"), seen.get("matrix_in"), seen.get("matrix_out")
        if (
            isinstance(hidden, torch.Tensor)
            and isinstance(matrix_in, torch.Tensor)
            and matrix_in.dim() == 3
            and 0 < matrix_in.shape[1] <= hidden.shape[1]
            and torch.equal(hidden[:, hidden.shape[1] - matrix_in.shape[1] :], matrix_in)
            and isinstance(matrix_out, torch.Tensor)
            and torch.equal(matrix_out, logits)
            and dense(matrix.weight)  # a quantized matrix (torchao's) multiplies only as F.linear
        ):
            self.body, self.weight = body, matrix.weight
            sizes = self.requested if self.requested is not None else tall_sizes_for(matrix.weight, self.cache_dir)
            self.tall_sizes = frozenset(n for n in sizes if 1 <= n <= TALL_MAX_POSITIONS)
        return logits


def tall_product(weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """(W @ h^T)^T, contiguous: `weight` W [vocab, hidden], `flat` h [n, hidden] -> [n, vocab]. One row is written
    twice and the first column kept: a matrix kernel instead of MKL's slower matrix-vector one (module docstring).

    Example:
        >>> weight, flat = torch.randn(10, 4), torch.randn(1, 4)
        >>> tall_product(weight, flat).shape, torch.allclose(tall_product(weight, flat), flat @ weight.T)
        (torch.Size([1, 10]), True)
    """
    if flat.shape[0] == 1:
        return torch.matmul(weight, torch.cat([flat, flat]).T)[:, :1].T.contiguous()
    return torch.matmul(weight, flat.T).T.contiguous()


def tall_sizes_for(weight: torch.Tensor, cache_dir: Path | str | None = DEFAULT_CACHE_DIR) -> frozenset[int]:
    """The row counts at which (W @ h^T)^T measured at most TALL_MARGIN of F.linear(h, W)'s time for this output
    matrix `weight` [vocab, hidden] on this device: read from `cache_dir`, else measured now and stored there."""
    settings = {
        "matrix": list(weight.shape),
        "dtype": str(weight.dtype).removeprefix("torch."),
        "device": device_name(weight.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "version": LAYOUTS_VERSION,
    }
    digest = settings_digest(settings)
    name = f"{weight.shape[0]}x{weight.shape[1]}-{settings['dtype']}-t{settings['threads']}-{digest}.json"
    path = None if cache_dir is None else Path(cache_dir).expanduser() / "head" / name
    stored = read_json(path) if path is not None else None
    tall_stored = stored.get("tall") if stored is not None else None
    if isinstance(tall_stored, list) and all(type(n) is int for n in tall_stored):  # else: measured again
        return frozenset(tall_stored)
    timings = time_layouts(weight, range(1, TALL_MAX_POSITIONS + 1))
    tall = sorted(n for n, (linear, product) in timings.items() if product <= TALL_MARGIN * linear)
    if path is not None:
        record = {n: {"linear_ms": linear * 1e3, "tall_ms": product * 1e3} for n, (linear, product) in timings.items()}
        try:
            write_json(path, {"settings": settings, "tall": tall, "timings": record})
        except OSError:
            pass  # a read-only home: the choice still serves this process
    return frozenset(tall)


@torch.inference_mode()
def time_layouts(weight: torch.Tensor, sizes: Sequence[int], repeats: int = 3) -> dict[int, tuple[float, float]]:
    """Seconds of F.linear(h, W) and of `tall_product(W, h)` for h of n rows, per n in `sizes`: the
    fastest of `repeats` interleaved rounds after a warm-up round (load only ever slows a call down)."""
    generator = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(1, n, weight.shape[1], generator=generator).to(weight) for n in sizes}
    samples: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):
        for n, hidden in inputs.items():
            started = time.perf_counter()
            torch.nn.functional.linear(hidden, weight)
            middle = time.perf_counter()
            tall_product(weight, hidden[0])
            samples[n].append((middle - started, time.perf_counter() - middle))
    return {n: (min(s[0] for s in runs[1:]), min(s[1] for s in runs[1:])) for n, runs in samples.items()}


def last_logits(model: torch.nn.Module, n: int) -> dict[str, int]:
    """{'logits_to_keep': n} when `model.forward` takes it: a prefill then skips the LM head on every prompt
    position but the last n (with a 150k vocabulary that is most of a short prompt's prefill), as generate does."""
    return {"logits_to_keep": n} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
