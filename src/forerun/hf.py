"""transformers drop-in: pass `custom_generate=forerun.hf_generate` to `model.generate`.

transformers (>= 5) prepares the inputs, the logits processors and the stopping criteria (max length, EOS, stop
strings), then calls this function; forerun decodes with them, so the result is what plain greedy would give.

Example:
    >>> out = model.generate(**inputs, custom_generate=forerun.hf_generate,          # doctest: +SKIP
    ...                      forerun_method="auto", max_new_tokens=64, do_sample=False)
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from forerun.decoder import Decoder, custom_generate
from forerun.methods import DEFAULT_METHOD


def hf_generate(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: object | None = None,
    forerun_method: str = DEFAULT_METHOD,
    forerun_knobs: dict | None = None,
    forerun_decoder: Decoder | None = None,
    forerun_streamer: object | None = None,
    forerun_generator: torch.Generator | None = None,
    **model_kwargs: object,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """A `custom_generate` callable. `forerun_decoder` reuses a Decoder (its pools, tries and calibration persist);
    else one is built from `forerun_method` and `forerun_knobs` for this call.

    Streaming: transformers 5.23 forwards only the callable's own new keyword arguments, so `streamer=` never
    reaches a custom_generate callable (it only receives the prompt). Pass `forerun_streamer=` instead: it gets the
    prompt, then the new tokens as they are committed, then `end()`.

    Sampling (do_sample=True) keeps exactly the distribution of plain sampling, with the processors transformers
    built from the generation config; each sequence's noise seed (`forerun.noise`) is drawn from
    `forerun_generator`, else torch's global generator (so `torch.manual_seed` makes runs repeat, as with plain
    generate, and what forerun drafts never changes the text).
    """
    decoder = forerun_decoder or Decoder(model, None, forerun_method, **(forerun_knobs or {}))
    return custom_generate(
        model,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus,
        streamer,
        forerun_decoder=decoder,
        forerun_streamer=forerun_streamer,
        forerun_generator=forerun_generator,
        **model_kwargs,
    )
