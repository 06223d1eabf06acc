"""vLLM's `/tokenize` and `/detokenize`: a prompt into the ids the model reads (a chat's through its template, as
a chat completion renders it: a client counts a conversation's tokens before it sends it), and ids into text.

Example:
    >>> import httpx                                                                             # doctest: +SKIP
    >>> httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()  # doctest: +SKIP
    {'count': 13, 'max_model_len': 8192, 'tokens': [1, 9690, ...]}
    >>> httpx.post(url + "/detokenize", json={"tokens": [9690]}).json()                         # doctest: +SKIP
    {'prompt': 'system'}
"""

from __future__ import annotations

import asyncio

from forerun.checks import check_text
from forerun.prompts import rendered
from forerun.server.fields import APIError, refuse
from forerun.server.schemas import ChatRequest, DetokenizeRequest, TokenizeRequest
from forerun.server.translate import check_model, translate


async def tokenized(service, body: TokenizeRequest) -> dict:
    """`/tokenize`'s answer: {"count", "max_model_len", "tokens"} and "token_strs" where asked; a 400 names what
    is wrong (both or neither of prompt and messages, anything a chat completion refuses in its messages)."""
    check_model(body.model, service.limits)
    if (body.prompt is None) == (body.messages is None):
        raise refuse("prompt", "give a prompt or messages, one of them")
    tokenizer = service.tokenizer
    if body.prompt is not None:
        try:
            check_text("prompt", body.prompt)
        except ValueError as error:
            raise refuse("prompt", str(error)) from None
        ids = (await asyncio.to_thread(tokenizer, body.prompt, add_special_tokens=body.add_special_tokens))["input_ids"]
    else:
        chat = ChatRequest(messages=body.messages, tools=body.tools, chat_template_kwargs=body.chat_template_kwargs,
                           continue_final_message=body.continue_final_message or None)  # fmt: skip
        args = translate(chat, service.limits)  # the messages, tools and variables a chat completion takes
        try:
            ids = await asyncio.to_thread(rendered, tokenizer, args.prompt, args.tools, args.chat_template_kwargs,
                                          body.add_generation_prompt, body.continue_final_message)  # fmt: skip
        except ValueError as error:
            raise APIError(400, str(error), "messages") from None
    answer = {"count": len(ids), "max_model_len": service.limits.context, "tokens": ids}
    if body.return_token_strs:
        answer["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return answer


def detokenized(service, body: DetokenizeRequest) -> dict:
    """`/detokenize`'s answer: {"prompt": the text of `tokens`}; an id outside the vocabulary is a 400."""
    check_model(body.model, service.limits)
    vocab = service.limits.vocab_size or len(service.tokenizer)
    bad = next((i for i, token in enumerate(body.tokens) if not 0 <= token < vocab), None)
    if bad is not None:
        raise refuse("tokens", f"tokens[{bad}] is {body.tokens[bad]}, outside the vocabulary [0, {vocab})")
    return {"prompt": service.tokenizer.decode(body.tokens)}
