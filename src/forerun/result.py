"""What one generation returns: its tokens and text, where each token came from, its statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forerun.logprobs import TokenLogprob
from forerun.stats import GenerationStats
from forerun.thoughts import Thought, split
from forerun.tool_calls import ToolCall, read_answer


@dataclass
class GenerationResult:
    """What one generation returns."""

    sequences: torch.Tensor
    """LongTensor [1, prompt_len + new_tokens], the same as model.generate(..., do_sample=False)."""
    prompt_len: int
    text: str | None
    """The decoded new tokens (None without a tokenizer)."""
    stats: GenerationStats
    token_sources: list[str]
    """Per new token: 'model' or the drafter whose guess was accepted ('prediction' for a predicted output)."""
    logprobs: list[TokenLogprob] | None = None
    """Per new token, with `generate(..., logprobs=k)`: its log-probability under the raw model, k alternatives."""
    prediction_tokens: int = 0
    """Tokens of the request's prediction (0 without one)."""
    finish_reason: str = "stop"
    """'stop' (EOS or a stop string), 'length' (max_new_tokens reached) or 'tool_calls' (it ended after making
    calls), as OpenAI says it."""
    stop_at: int | None = None
    """Where in `text` the first stop string begins (the text shown ends there), or None."""
    tool_calls: tuple[ToolCall, ...] | None = None
    """The calls the answer makes, in order, where the request offered tools (`forerun.tool_calls`); None where it
    offered none. An answer that makes calls finishes with 'tool_calls'."""
    calls_at: int | None = None
    """Where in `text` a mark the decoded text drops opened the calls (`forerun.tool_calls.marked_at`), or None."""
    thought: Thought | None = None
    """Where in `text` a reasoning model's thought stands (`forerun.thoughts`), or None where it wrote none."""

    @property
    def shown_text(self) -> str:
        """`text` up to the first stop string, as OpenAI's answers show it."""
        text = self.text or ""
        return text if self.stop_at is None else text[: self.stop_at]

    @property
    def reasoning(self) -> str | None:
        """The thought's text (`thought`), stripped; None where the answer has none."""
        return split(self.shown_text, self.thought)[0]

    @property
    def content(self) -> str | None:
        """The answer's text less its thought and its calls (None where it is only calls): `shown_text` where
        the model neither thought nor was offered tools."""
        if self.tool_calls is None:
            return split(self.shown_text, self.thought)[1]
        return read_answer(self.shown_text, self.thought, {call.name for call in self.tool_calls}, self.calls_at)[0]

    @property
    def new_tokens(self) -> list[int]:
        return self.sequences[0, self.prompt_len :].tolist()

    @property
    def accepted_prediction_tokens(self) -> int:
        """New tokens that came from the prediction (OpenAI's usage.completion_tokens_details field)."""
        return self.stats.accepted_by.get("prediction", 0)

    @property
    def rejected_prediction_tokens(self) -> int:
        """Prediction tokens that did not make it into the answer through the prediction."""
        return max(0, self.prediction_tokens - self.accepted_prediction_tokens)
