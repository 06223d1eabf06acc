"""Prompts into token ids, checked: text (raw or wrapped by the chat template), chat messages, or ids.

Every refusal is a ValueError that names what was wrong (empty, ids outside the vocabulary, beyond the context, a
chat template that rejects the messages), raised before anything runs.

Example:
    >>> encode_prompt(model, tokenizer, "Hi", chat=True).shape          # doctest: +SKIP
    torch.Size([1, 31])
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from forerun.checks import MAX_DEPTH, check_text, check_text_length, nesting
from forerun.request import Prompt
from forerun.template_kwargs import checked_template_kwargs, template_variables
from forerun.tool_pythonic import into_content
from forerun.tool_specs import kind_of, takes_tools, templates


def encode_prompt(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: Prompt,
    chat: bool = False,
    tools: Sequence[dict] | None = None,
    template_kwargs: Mapping[str, object] | None = None,
    continued: bool = False,
) -> torch.Tensor:
    """Prompt -> input_ids [1, L] (long, on the host): a string (chat=True wraps it as one user message), messages,
    or ids (a list, or a [L] / [1, L] tensor); `tools` (checked, `forerun.tool_specs`) shown by the chat template,
    `template_kwargs` given to it (`forerun.template_kwargs`: each a variable it reads); `continued`: the last
    message is left open for the answer to continue, no new turn opened (`rendered`)."""
    if isinstance(prompt, (bytes, bytearray)):  # iterating bytes gives ints: it would pass as token ids
        raise ValueError("prompt is bytes: decode it to text first, or pass token ids as a list")
    if not isinstance(prompt, (torch.Tensor, str, list, tuple)):
        kind = type(prompt).__name__
        raise ValueError(f"prompt must be text, a list of chat messages or token ids (a list or a tensor), got {kind}")
    messages = isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)
    if tools and not (messages or (isinstance(prompt, str) and chat)):
        raise ValueError("tools are shown by the chat template: give chat messages (or text with chat=True)")
    if template_kwargs and not (messages or (isinstance(prompt, str) and chat)):
        raise ValueError("chat_template_kwargs are given to the chat template: give chat messages (or chat=True)")
    if isinstance(prompt, torch.Tensor):
        ids = ids_of_tensor(prompt)
    elif isinstance(prompt, str) or messages:
        ids = ids_of_text(model, tokenizer, prompt, chat, tools, template_kwargs, continued)
    else:
        values = list(prompt)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError("a prompt given as a list must hold integer token ids")
        ids = torch.tensor([values], dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("prompt is empty")
    vocab = model.get_input_embeddings().num_embeddings
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"prompt has token ids outside the model's vocabulary [0, {vocab})")
    return ids.to(dtype=torch.long)


def ids_of_tensor(prompt: torch.Tensor) -> torch.Tensor:
    """input_ids [L] or [1, L] of integers -> [1, L]."""
    if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got a {prompt.dtype} tensor")
    if prompt.dim() not in (1, 2):
        raise ValueError(f"input_ids must be [length] or [1, length], got shape {list(prompt.shape)}")
    ids = prompt if prompt.dim() == 2 else prompt.unsqueeze(0)
    if ids.shape[0] != 1:
        raise ValueError(f"forerun decodes one sequence at a time; got a batch of {ids.shape[0]}")
    return ids.cpu()


def ids_of_text(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase | None,
    prompt: str | Sequence[dict],
    chat: bool,
    tools: Sequence[dict] | None = None,
    template_kwargs: Mapping[str, object] | None = None,
    continued: bool = False,
) -> torch.Tensor:
    """Text or chat messages -> input_ids [1, L], through the tokenizer (and its chat template for messages, which
    shows `tools` and is given `template_kwargs`, the last message left open where `continued`)."""
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; pass token ids or give Decoder a tokenizer")
    if isinstance(prompt, str) and not prompt.strip():
        raise ValueError("prompt is empty")
    context = getattr(model.config, "max_position_embeddings", None)
    if isinstance(prompt, str):
        check_text_length("prompt", len(prompt), context)
        check_text("prompt", prompt)
    else:
        for i, message in enumerate(prompt):
            check_message(i, message)
        total = sum(len(message.get("content") or "") + len(str(message.get("tool_calls", "")))
                    + len(message.get("reasoning_content") or "") for message in prompt)  # fmt: skip
        check_text_length("the messages' content", total, context)
    if isinstance(prompt, str) and not chat:
        return tokenizer(prompt, return_tensors="pt").input_ids
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if tools and not takes_tools(tokenizer):
        raise ValueError(
            "tools: this model's chat template does not teach tool calls in a format forerun reads (<tool_call> "
            "blocks, as Qwen2.5, Qwen3 and Hermes templates do, Llama 3's JSON calls, or JSON calls after a special "
            "token, as Mistral's [TOOL_CALLS]); give the tokenizer such a "
            "chat template (ChatML models: "
            "forerun.tool_specs.shipped_template('chatml-tools'), --chat-template chatml-tools on the command line)"
        )
    kwargs = checked_template_kwargs(template_kwargs, template_variables(tokenizer)) if template_kwargs else {}
    return torch.tensor([rendered(tokenizer, messages, tools, kwargs, continued=continued)])


def rendered(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    template_kwargs: Mapping[str, object] | None = None,
    generation_prompt: bool = True,
    continued: bool = False,
) -> list[int]:
    """The ids of checked `messages` through the chat template (with `tools` and its checked `template_kwargs`),
    the assistant's turn opened where `generation_prompt`, or the last message left open where `continued`
    (transformers' `continue_final_message`: the template's end of that turn cut off): every prompt a chat gives,
    and `/tokenize`'s count. A template that shows an assistant's calls only as its content (LFM2's) gets them
    written there."""
    try:
        if kind_of(templates(tokenizer)) == "pythonic":
            messages = into_content(messages)  # a call it cannot write is the messages' fault too
        return tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, add_generation_prompt=generation_prompt and not
            continued, continue_final_message=continued, return_dict=True, **(template_kwargs or {}),
        )["input_ids"]  # fmt: skip
    except Exception as error:  # the template runs on the caller's messages: its refusals are theirs
        raise ValueError(f"the chat template refused these messages: {error}") from error


def check_message(i: int, message: object) -> None:
    """One chat message: a dict with a string role and string content; an assistant's calls (`tool_calls`, as
    transformers' templates take them) may stand for its content."""
    if not isinstance(message, dict):
        raise ValueError(f"messages[{i}] must be a dict with a string 'content'")
    calls = message.get("tool_calls")
    if not isinstance(message.get("content"), str) and not (calls and message.get("content") is None):
        raise ValueError(f"messages[{i}] must be a dict with a string 'content'")
    if not isinstance(message.get("role", "user"), str):
        raise ValueError(f"messages[{i}].role must be a string, got {message['role']!r:.40}")
    check_text(f"messages[{i}].content", message.get("content") or "")
    thought = message.get("reasoning_content")
    if thought is not None:  # an assistant's thought, as Qwen3's template shows it
        if not isinstance(thought, str):
            raise ValueError(f"messages[{i}].reasoning_content must be a string, got {type(thought).__name__}")
        check_text(f"messages[{i}].reasoning_content", thought)
    if calls is not None:
        if not isinstance(calls, list):
            raise ValueError(f"messages[{i}].tool_calls must be a list of calls")
        if nesting(calls) > MAX_DEPTH:
            raise ValueError(f"messages[{i}].tool_calls nest more than {MAX_DEPTH} levels")
        check_text(f"messages[{i}].tool_calls", json.dumps(calls, ensure_ascii=False, default=str))


def check_context(model: torch.nn.Module, ids: torch.Tensor, max_new_tokens: int) -> None:
    """The prompt [1, L] and the answer must fit the model's context."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and ids.shape[1] + max_new_tokens > context:
        raise ValueError(
            f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model context "
            f"({context} tokens)"
        )


def check_kinds(prompts: Sequence[object], chat: bool) -> None:
    """A batch must not mix raw text and chat messages unless `chat` wraps every text as a message."""
    has_text = any(isinstance(p, str) for p in prompts)
    has_messages = any(isinstance(p, (list, tuple)) and p and isinstance(p[0], dict) for p in prompts)
    if has_text and has_messages and not chat:
        raise ValueError(
            "the batch mixes raw text prompts and chat message lists; pass chat=True to wrap every text "
            "prompt as a user message, or make every prompt the same kind"
        )


def encode_prediction(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase | None, prediction: str | Sequence[int]
) -> list[int]:
    """A predicted output (text or ids) -> token ids, without special tokens."""
    if isinstance(prediction, str):
        if tokenizer is None:
            raise ValueError("a text prediction needs a tokenizer; pass token ids or give Decoder a tokenizer")
        check_text("prediction", prediction)
        return tokenizer(prediction, add_special_tokens=False)["input_ids"]
    return encode_prompt(model, tokenizer, list(prediction))[0].tolist()
