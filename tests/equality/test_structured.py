"""response_format: every method writes what plain generate writes with the request's constraint as its processor,
alone, batched beside free-text rows, greedy and sampled (`forerun.structured`)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LogitsProcessorList

import forerun
from forerun.costmodel import LatencyCurve

from tiny_models import byte_tokenizer, prompts, tiny_model

CURVE = LatencyCurve((1, 8, 32), (1.0, 1.1, 1.5))
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
FORMATS = {
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}},
}
METHODS = ("prompt_lookup", "trie", "jacobi", "auto")
NEW = 64
"""New tokens: room for the schema's JSON in byte-sized tokens (about 50)."""


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


def model_of(family: str, attention: str, tokenizer) -> torch.nn.Module:
    model = tiny_model(family, attention, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def constrained_generate(model, decoder, prompt, response_format, new_tokens, **kwargs) -> torch.Tensor:
    """Plain generate with the request's constraint as its logits processor (the reference)."""
    eos = model.generation_config.eos_token_id
    constraint = decoder.grammars.constraint(response_format, prompt.shape[1], frozenset({eos}))
    return model.generate(
        prompt,
        max_new_tokens=new_tokens,
        logits_processor=LogitsProcessorList([constraint]),
        pad_token_id=0,
        eos_token_id=eos,
        **kwargs,
    )


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_a_response_format_decodes_as_plain_generate_with_its_constraint(family, attention, tokenizer):
    """Greedy: every method, alone and in a batch beside a free-text row, writes generate's constrained text; the
    constraint changes the text (the control), and a schema's answer that ends is JSON matching it."""
    model = model_of(family, attention, tokenizer)
    texts = [p % len(tokenizer) for p in prompts(2)]
    reference = forerun.Decoder(model, tokenizer, "plain", latency=CURVE)
    ended = 0
    free = model.generate(texts[0], max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    for kind, response_format in FORMATS.items():
        expected = [constrained_generate(model, reference, p, response_format, NEW, do_sample=False) for p in texts]
        assert not torch.equal(expected[0], free), kind
        for method in METHODS:
            decoder = forerun.Decoder(model, tokenizer, method, latency=CURVE)
            alone = decoder.generate(texts[0], NEW, response_format=response_format)
            assert torch.equal(alone.sequences, expected[0]), (kind, method)
            if kind == "json_schema" and alone.finish_reason == "stop":
                record = json.loads(alone.text)
                assert set(record) == set(SCHEMA["required"]) and len(record["name"]) <= 6, alone.text
                ended += 1
            rows = [
                forerun.GenerationRequest(texts[0], NEW, response_format=response_format),
                forerun.GenerationRequest(texts[1], NEW),
                forerun.GenerationRequest(texts[1], NEW, response_format=response_format),
            ]
            batched = decoder.generate(rows)
            assert torch.equal(batched[0].sequences, expected[0]), (kind, method)
            assert torch.equal(batched[1].sequences, model.generate(texts[1], max_new_tokens=NEW, pad_token_id=0))
            assert torch.equal(batched[2].sequences, expected[1]), (kind, method)
    assert ended, "no schema answer ended within NEW tokens: its JSON went unchecked"


def test_a_seed_writes_the_same_constrained_text_with_every_method(tokenizer):
    """Sampled (temperature 1.3, top-p 0.95): a seed fixes the text whichever method drafts it, the mask holds
    every draw (each ended answer is JSON matching the schema), and seeds differ (the control)."""
    model = model_of("llama", "sdpa", tokenizer)
    prompt = prompts(1)[0] % len(tokenizer)
    settings = dict(do_sample=True, temperature=1.3, top_p=0.95, response_format=FORMATS["json_schema"])
    texts = {}
    for seed in (3, 4, 5):
        written = {
            method: forerun.Decoder(model, tokenizer, method, latency=CURVE).generate(prompt, 48, seed=seed, **settings)
            for method in ("plain", *METHODS)
        }
        assert len({r.text for r in written.values()}) == 1, seed
        result = written["plain"]
        if result.finish_reason == "stop":
            assert set(json.loads(result.text)) == set(SCHEMA["required"]), result.text
        texts[seed] = result.text
    assert len(set(texts.values())) == 3


def test_constrained_rows_choose_at_once_as_on_a_card(tokenizer, monkeypatch):
    """On a card a greedy row scores every node of its tree in one go (one call per depth level: the constraint
    reads each row's own ids, `forerun.draws.ROW_WISE`), drafted rows past a rejected guess included; forced here
    on the CPU, alone and batched: generate's constrained text."""
    from forerun import draws, row

    made = []
    monkeypatch.setattr(row, "choose_at_once", lambda logits: True)
    monkeypatch.setattr(row, "chosen_at_once", lambda scores: made.append(1) or draws.chosen(scores))
    model = model_of("qwen3", "sdpa", tokenizer)
    texts = [p % len(tokenizer) for p in prompts(2)]
    response_format = FORMATS["json_schema"]
    reference = forerun.Decoder(model, tokenizer, "plain", latency=CURVE)
    expected = [constrained_generate(model, reference, p, response_format, NEW, do_sample=False) for p in texts]
    decoder = forerun.Decoder(model, tokenizer, "auto", latency=CURVE)
    alone = decoder.generate(texts[0], NEW, response_format=response_format)
    assert torch.equal(alone.sequences, expected[0]) and len(made) == alone.stats.forwards
    assert alone.stats.forwards < alone.sequences.shape[1] - texts[0].shape[1]  # drafts were accepted
    batched = decoder.generate(texts, NEW, response_format=response_format)
    assert all(torch.equal(r.sequences, want) for r, want in zip(batched, expected, strict=True))
