"""transformers drop-in: pass `custom_generate=forerun.hf_generate` to `model.generate`.

transformers (>= 5) prepares the inputs, the logits processors and the stopping criteria (max length, EOS, stop
strings), then calls this function; forerun decodes with them, so the result is what plain greedy would give.

Example:
    >>> out = model.generate(**inputs, custom_generate=forerun.hf_generate,          # doctest: +SKIP
    ...                      forerun_method="prompt_lookup", max_new_tokens=64, do_sample=False)
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from forerun.decoder import Decoder, eos_ids_of
from forerun.engine import Sampling


def hf_generate(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: object | None = None,
    forerun_method: str = "prompt_lookup",
    forerun_knobs: dict | None = None,
    forerun_decoder: Decoder | None = None,
    forerun_streamer: object | None = None,
    forerun_generator: torch.Generator | None = None,
    **model_kwargs: object,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """A `custom_generate` callable. `forerun_decoder` reuses a Decoder (its pools/tries persist).

    Streaming: transformers 5.23 forwards only the callable's own new keyword arguments, so `streamer=` never
    reaches a custom_generate callable (it only receives the prompt). Pass `forerun_streamer=` instead: it gets the
    prompt, then the new tokens as they are committed, then `end()`.

    Sampling (do_sample=True) keeps exactly the distribution of plain sampling, with the processors transformers
    built from the generation config; random draws come from `forerun_generator`, else torch's global generator
    (so `torch.manual_seed` makes runs repeat, as with plain generate).
    """
    if forerun_streamer is not None:
        streamer = forerun_streamer
        streamer.put(input_ids.cpu())
    if generation_config.num_beams not in (None, 1):
        raise ValueError(f"forerun.hf_generate does not do beam search (num_beams={generation_config.num_beams})")
    if input_ids.shape[0] != 1:
        raise ValueError(f"forerun decodes one sequence at a time; got a batch of {input_ids.shape[0]}")
    mask = model_kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise ValueError("forerun does not take padded inputs: the attention mask has zeros")
    decoder = forerun_decoder or Decoder(model, None, forerun_method, **(forerun_knobs or {}))
    transcript, stats = decoder.decode(
        input_ids,
        stopping_criteria,
        eos_ids_of(model, generation_config.eos_token_id),
        generation_config.max_length - input_ids.shape[1],
        streamer,
        logits_processor,
        Sampling(forerun_generator, decoder.sample_verifier) if generation_config.do_sample else None,
    )
    if generation_config.return_dict_in_generate:
        output = GenerateDecoderOnlyOutput(sequences=transcript.sequence)
        output.forerun_stats = stats
        output.forerun_sources = transcript.sources
        return output
    return transcript.sequence
