"""The `forerun` command: generate, chat, serve, bench, curve, trie build, models.

Every command that loads a model takes the same run options (`--model --method --knob --device --dtype --threads`,
and `--draft-model --max-tree-nodes` where it decodes), parsed once into a `forerun.runspec.RunSpec` and checked
before the model loads. Bad input (unknown method, bad knob, empty prompt...) prints one `error:` line and exits
with status 2.

Example:
    forerun generate "def fib(n):" --method auto --max-new-tokens 64 -v
    forerun generate "Explain recursion" --chat --method prompt_lookup+trie --knob trie.decoding_length=16
    forerun bench --dataset gsm8k,humaneval --methods plain,trie,auto --dtype bf16
"""

# Each module registers its commands on `app`; `forerun --help` lists them in this order.
# isort: off
from forerun.cli import generate, serve, run, bench, curve, tools  # noqa: F401

# isort: on
from forerun.cli.common import app
from forerun.cli.curve import CURVE_SIZES
from forerun.cli.serve import parse_request_methods

__all__ = ["CURVE_SIZES", "app", "main", "parse_request_methods"]


def main() -> None:  # pragma: no cover - console entry point
    app()
