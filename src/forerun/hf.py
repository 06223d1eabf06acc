"""transformers drop-in: pass `custom_generate=forerun.hf_generate` to `model.generate`.

transformers (>= 5) prepares the inputs, the logits processors and the stopping criteria (max length, EOS, stop
strings), then calls this function; forerun decodes with them, so the result is what plain greedy would give.

Example:
    >>> out = model.generate(**inputs, custom_generate=forerun.hf_generate,          # doctest: +SKIP
    ...                      forerun_method="auto", max_new_tokens=64, do_sample=False)
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.logits_process import (
    ClassifierFreeGuidanceLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from forerun.batched import decode_batch
from forerun.checks import check_decoding_mode
from forerun.decoder import Decoder
from forerun.defaults import DEFAULT_METHOD
from forerun.hf_rows import PaddedRowProcessors, step_scores
from forerun.noise import GumbelNoise
from forerun.preparation import eos_ids_of
from forerun.row import RowJob
from forerun.transcript import Transcript
from forerun.verify import Sampling


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

    Streaming: transformers (5.23 to 5.25) forwards only the callable's own new keyword arguments, so `streamer=` never
    reaches a custom_generate callable (it only receives the prompt). Pass `forerun_streamer=` instead: it gets the
    prompt, then the new tokens as they are committed, then `end()`.

    Sampling (do_sample=True) keeps exactly the distribution of plain sampling, with the processors transformers
    built from the generation config; each sequence's noise seed (`forerun.noise`) is drawn from
    `forerun_generator`, else torch's global generator (so `torch.manual_seed` makes runs repeat, as with plain
    generate, and what forerun drafts never changes the text).
    """
    check_generation_config(generation_config, logits_processor)  # before a Decoder is made for nothing
    if model_kwargs.get("inputs_embeds") is not None or input_ids.shape[1] == 0:
        raise ValueError("forerun reads the prompt as token ids (input_ids); inputs_embeds is not supported")
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


def custom_generate(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer: object | None = None,
    forerun_decoder: Decoder | None = None,
    forerun_streamer: object | None = None,
    forerun_generator: torch.Generator | None = None,
    **model_kwargs: object,
):
    """`hf_generate`'s decoding, once it has checked the call and has a Decoder: decode with the processors and
    criteria transformers built (streaming and sampling: `hf_generate`)."""
    if forerun_streamer is not None:
        streamer = forerun_streamer
        streamer.put(input_ids.cpu())
    decoder = forerun_decoder

    def sampling() -> Sampling | None:
        """A sampled sequence's own noise (each row of a batch gets its own seed, drawn in row order)."""
        return Sampling(GumbelNoise.drawn(forerun_generator)) if generation_config.do_sample else None

    mask = model_kwargs.get("attention_mask")
    if input_ids.shape[0] != 1 or (isinstance(mask, torch.Tensor) and not bool(mask.all())):
        if streamer is not None:
            raise ValueError("forerun streams one sequence; a batch cannot take a streamer")
        with decoder.lock:  # its drafters' forks and budget, while other threads' calls wait
            return batch_custom_generate(
                model, input_ids, mask, logits_processor, stopping_criteria, generation_config, decoder, sampling
            )
    processor = PaddedRowProcessors(logits_processor, input_ids[:, :0], row=0)
    eos = eos_ids_of(model, generation_config.eos_token_id)
    max_new_tokens = generation_config.max_length - input_ids.shape[1]
    keep = wants_scores(generation_config)
    transcript, stats = decoder.decode(
        input_ids, stopping_criteria, eos, max_new_tokens, streamer, processor, sampling(), keep_logits=keep
    )
    if not generation_config.return_dict_in_generate:
        return transcript.sequence
    output = dict_output(transcript.sequence, [transcript], [processor], generation_config, eos)
    output.forerun_stats = stats
    output.forerun_sources = transcript.sources
    output.forerun_transcript = transcript
    return output


GUIDANCE = (ClassifierFreeGuidanceLogitsProcessor, UnbatchedClassifierFreeGuidanceLogitsProcessor)
UNSUPPORTED_OUTPUTS = {"output_attentions": "attentions", "output_hidden_states": "hidden states"}


def check_generation_config(config: GenerationConfig, processors: LogitsProcessorList | None) -> None:
    """Refuse what forerun does not do, naming it, rather than decode something else: beam search, contrastive
    search, DoLa and the other decoding modes (forerun decodes greedily or samples), per-step attentions or
    hidden states (its forwards verify trees of guesses; scores and logits it returns), and scores under
    classifier-free guidance (its processor runs the model on a cache of its own, fed once per position: the
    walk feeds it the committed tokens in order, but scores computed afterwards would feed it again)."""
    check_decoding_mode(config)
    if wants_scores(config) and any(isinstance(p, GUIDANCE) for p in processors or ()):
        raise ValueError("forerun's drop-in returns no scores or logits under guidance_scale (classifier-free)")
    if config.return_dict_in_generate:
        for flag, what in UNSUPPORTED_OUTPUTS.items():
            if getattr(config, flag, False):
                raise ValueError(
                    f"forerun's drop-in does not return {what} ({flag}=True): its forwards verify trees of guesses, "
                    "not one token each (output_scores and output_logits it returns)"
                )


def wants_scores(config: GenerationConfig) -> bool:
    """Whether the call returns per-step scores or logits (kept per new token while decoding)."""
    return bool(config.return_dict_in_generate and (config.output_scores or config.output_logits))


def dict_output(
    sequences: torch.Tensor,
    transcripts: list[Transcript],
    processors: list[LogitsProcessorList],
    config: GenerationConfig,
    eos: frozenset[int],
) -> GenerateDecoderOnlyOutput:
    """`return_dict_in_generate=True`'s output: the sequences, and `scores` / `logits` where asked."""
    output = GenerateDecoderOnlyOutput(sequences=sequences)
    if wants_scores(config):
        scores, logits = step_scores(transcripts, processors, pad_id_of(config, eos))
        output.scores = scores if config.output_scores else None
        output.logits = logits if config.output_logits else None
    return output


def pad_id_of(config: GenerationConfig, eos: frozenset[int]) -> int:
    """The token a finished row is padded with: the config's pad id, else an EOS id, else 0."""
    if config.pad_token_id is not None:
        return int(config.pad_token_id)
    return min(eos) if eos else 0


def batch_custom_generate(
    model, input_ids, mask, logits_processor, stopping_criteria, generation_config, decoder: Decoder, sampling
):
    """A left-padded batch through `custom_generate`: each row decoded without its padding (`forerun.batch`), the
    output laid out as plain batched generate lays it out: [rows, padded prompt + longest answer], rows that
    finished earlier filled with the pad token.

    Per row, the stopping criteria are transformers' own except the length, which counts from the row's own
    prompt; the logits processors see each row as plain batched generate shows it to them (`PaddedRowProcessors`).
    """
    rows, padded_len = input_ids.shape
    if mask is None:
        mask = torch.ones_like(input_ids)
    max_new_tokens = generation_config.max_length - padded_len
    eos = eos_ids_of(model, generation_config.eos_token_id)
    kept = StoppingCriteriaList(c for c in stopping_criteria if not isinstance(c, MaxLengthCriteria))
    jobs, pads, processors = [], [], []
    for row in range(rows):
        real = mask[row].bool()
        pad = int((~real).sum())
        if bool((~real[pad:]).any()) or not bool(real[pad:].all()):
            raise ValueError(f"row {row} of the batch is not left-padded (pad with padding_side='left')")
        if pad == padded_len:
            raise ValueError(f"row {row} of the batch is all padding")
        ids = input_ids[row : row + 1, pad:]
        criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=ids.shape[1] + max_new_tokens), *kept])
        transcript = Transcript(ids, criteria, keep_logits=wants_scores(generation_config))
        processor = PaddedRowProcessors(logits_processor, input_ids[row : row + 1, :pad], row)
        jobs.append(RowJob(ids, transcript, decoder.row_drafters(), eos, max_new_tokens, processor, sampling()))
        pads.append(pad)
        processors.append(processor)
    budget = decoder.batch_budget() if len(jobs) > 1 else decoder.budget
    stats = [decoder.told(row) for row in decode_batch(model, jobs, budget, together=decoder.batches)]
    longest = max(job.transcript.sequence.shape[1] + pad for job, pad in zip(jobs, pads, strict=True))
    sequences = input_ids.new_full((rows, longest), pad_id_of(generation_config, eos))
    for row, (job, pad) in enumerate(zip(jobs, pads, strict=True)):
        sequences[row, :pad] = input_ids[row, :pad]
        sequences[row, pad : pad + job.transcript.sequence.shape[1]] = job.transcript.sequence[0]
    if generation_config.return_dict_in_generate:
        transcripts = [job.transcript for job in jobs]
        output = dict_output(sequences, transcripts, processors, generation_config, eos)
        output.forerun_stats = stats
        output.forerun_sources = [job.transcript.sources for job in jobs]
        return output
    return sequences
