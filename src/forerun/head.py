"""A forward's logits, with the output matrix applied in the layout this CPU computes fastest for a few positions.

A causal LM is a body (embeddings and layers, `model.model`) and an output matrix W [vocab, hidden] applied to the
body's last hidden states h [n, hidden]. Verifying a tree needs logits at each of its n nodes. On a CPU in fp32,
MKL computes the model's `F.linear(h, W)` with few rows (n small) as n passes over W, but the same product written
as W @ h^T (a tall matrix times a few columns) in about one. SmolLM2-135M's 49152 x 576 matrix, 1 thread, AVX2
EPYC, ms for n = 1 / 2 / 3 / 4 / 8 / 16 rows:

    F.linear(h, W)          8.2   18.9   27.8   18.7   21.6   27.2
    (W @ h^T)^T             8.2    9.4   12.3   10.1   17.4   30.5   (made contiguous)

(the AVX-512 machine of issue 16 showed the same shape: 6.9 / 15 / 21 / 9.5 ms for 1 / 2 / 3 / 4). That output
matrix is a sixth of a 1-token forward, so a 2-token forward costs 1.44x one token instead of 1.66x.

So for forwards of 2 to `TALL_MAX_POSITIONS` positions forerun calls the body and computes the logits as
(W @ h^T)^T; every other forward is the model's own call. The split is used only where it is the same computation:
the first forward (the prefill) runs the whole model with hooks on its body and its output matrix, and the split is
taken from then on only if the model's logits were exactly the output matrix applied to exactly the body's last
hidden states (a bias-free `nn.Linear`): Gemma 2's logit softcapping, Granite's logit scaling or MiniCPM's scaled
hidden states keep the whole-model call. Only on a CPU in fp32: in bf16 the matrix costs the same for 1 to 4 rows
(3.4 / 3.5 / 3.5 / 3.6 ms), and GPU matrix kernels have no such small-row path. The two layouts round differently
(sums in another order: up to 1 unit in the last place); fp32 outputs stay identical to plain generate, as the
equality tests across the model families check.

Example:
    >>> head = LogitsHead(model)                                          # doctest: +SKIP
    >>> head(input_ids=prompt, past_key_values=cache).shape               # the prefill decides  # doctest: +SKIP
    torch.Size([1, 12, 49152])
    >>> head.tall                                                         # doctest: +SKIP
    True
"""

from __future__ import annotations

import torch

from forerun.models import last_logits

TALL_MAX_POSITIONS = 8
"""Most positions whose logits are computed as (W @ h^T)^T: from 16 rows on, F.linear is as fast (table above)."""


class LogitsHead:
    """Calls `model` for logits [rows, positions, vocab]; decides at its first call whether a tall product may
    replace the model's own output matrix for a few positions (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.keeps_logits = bool(last_logits(model, 1))
        self.decided = False
        self.body: torch.nn.Module | None = None
        """The model's body when the split was found equal to the model's own forward, else None."""
        self.weight: torch.Tensor | None = None
        """Its output matrix [vocab, hidden], with `body`."""

    @property
    def tall(self) -> bool:
        """Whether forwards of 2 to TALL_MAX_POSITIONS positions compute their logits as (W @ h^T)^T."""
        return self.body is not None

    def __call__(self, keep: int | None = None, **inputs: object) -> torch.Tensor:
        """The logits of one forward of `inputs` (the model's keyword arguments, `input_ids` [rows, n] among
        them): [rows, n, vocab], or the last `keep` positions' [rows, keep, vocab] where the model takes
        `logits_to_keep` (others return all n: callers take the last positions they need)."""
        kept = {"logits_to_keep": keep} if keep is not None and self.keeps_logits else {}
        if not self.decided:
            return self.decide(inputs, kept)
        rows, n = inputs["input_ids"].shape  # type: ignore[union-attr]
        positions = min(keep, n) if kept else n
        if self.body is None or not 2 <= rows * positions <= TALL_MAX_POSITIONS:
            return self.model(**inputs, **kept).logits
        hidden = self.body(**inputs).last_hidden_state[:, n - positions :]  # [rows, positions, hidden]
        flat = hidden.reshape(rows * positions, -1)
        # [vocab, hidden] @ [hidden, rows * positions], transposed back
        return torch.matmul(self.weight, flat.T).T.contiguous().view(rows, positions, -1)

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
        ):
            self.body, self.weight = body, matrix.weight
        return logits
