"""A final assistant message continued (`GenerationRequest.continue_final_message`: Anthropic's prefill, vLLM's
`continue_final_message`): the answer is what plain generate writes after the template's rendering of the
messages with that message left open, for every method, alone and in a batch; a request that cannot continue is
refused by name."""

from __future__ import annotations

import pytest

import forerun
from forerun.request import GenerationRequest

from tiny_models import byte_tokenizer, tiny_model

TEMPLATE = (
    "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TURNS = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]


@pytest.fixture(scope="module")
def served():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    model = tiny_model("llama", "eager", seed=0, vocab_size=len(tokenizer), max_position_embeddings=512)
    return model, tokenizer


@pytest.mark.parametrize("method", ["plain", "auto"])
def test_the_answer_continues_the_assistants_text_as_plain_generate_does(served, method):
    model, tokenizer = served
    ids = tokenizer.apply_chat_template(TURNS, continue_final_message=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]  # fmt: skip
    assert tokenizer.decode(ids[0]).endswith("The colour is")  # left open: no end of turn, no new turn
    expected = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
    decoder = forerun.Decoder(model, tokenizer, method)
    request = GenerationRequest(TURNS, 12, continue_final_message=True)
    assert decoder.generate(request).new_tokens == expected
    other = GenerationRequest([TURNS[0]], 12)
    results = decoder.generate([request, other])  # a batch: each row's own prompt
    assert results[0].new_tokens == expected
    assert results[1].new_tokens == decoder.generate(other).new_tokens


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        ([TURNS[0]], "the last is a user's"),
        ([TURNS[0], {"role": "assistant", "content": "  "}], "without text to continue"),
        ("Hi", "needs chat messages"),
    ],
)
def test_a_request_that_cannot_continue_is_refused(prompt, fragment):
    with pytest.raises(ValueError, match=fragment):
        GenerationRequest(prompt, 4, continue_final_message=True)


def test_a_jsonl_record_continues_its_last_message(served, tmp_path):
    """`forerun run`: a record's `continue_final_message` continues its assistant's words (the prompt encoded once,
    left open), the text plain generate's; a record that cannot continue fails alone."""
    import json

    from forerun.runner import parse_record, run_records

    model, tokenizer = served
    lines = [{"id": "on", "messages": TURNS, "continue_final_message": True},
             {"id": "bad", "messages": TURNS[:1], "continue_final_message": True}]  # fmt: skip
    records = [parse_record(json.dumps(line), k + 1, {"max_new_tokens": 12}, k) for k, line in enumerate(lines)]
    out = tmp_path / "out.jsonl"
    run_records(forerun.Decoder(model, tokenizer, "auto"), records, out, batch_size=2)
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    expected = forerun.Decoder(model, tokenizer, "plain").generate(
        GenerationRequest(TURNS, 12, continue_final_message=True)
    )
    assert rows["on"]["text"] == expected.text and "the last is a user's" in rows["bad"]["error"]
