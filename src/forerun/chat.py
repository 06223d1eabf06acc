"""`forerun chat`: an interactive terminal chat on one Decoder, streaming, tokens coloured by origin.

Commands: /reset (clear the history), /method NAME (switch drafting method: any method expression, e.g. auto or
prompt_lookup+trie), /quit. Ctrl-C stops the answer being written, not the program; Ctrl-D or /quit leaves.
"""

from __future__ import annotations

import signal
import threading

from rich.console import Console

from forerun.checks import check_text
from forerun.decoder import Decoder
from forerun.methods import source_style
from forerun.runspec import RunSpec
from forerun.stopping import HeldText
from forerun.text import IncrementalText


class ConsoleStream:
    """Prints each committed token as it arrives, styled by where it came from."""

    def __init__(self, console: Console, tokenizer) -> None:
        self.console = console
        self.text = IncrementalText(tokenizer)
        self.pending_sources: list[str] = []
        self.prompt_seen = False

    def note_sources(self, sources: list[str]) -> None:
        self.pending_sources = list(sources)

    def show(self, piece: str, source: str = "model") -> None:
        if piece:
            self.console.print(piece, style=source_style(source), end="", markup=False, highlight=False, soft_wrap=True)

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        tokens = value.flatten().tolist()
        for token, source in zip(tokens, self.pending_sources or ["model"] * len(tokens), strict=False):
            self.show(self.text.push([token]), source)
        self.pending_sources = []

    def end(self) -> None:
        self.show(self.text.finish())
        self.console.print()


class AnswerStream:
    """Prints an answer as it is written (`forerun generate`): whole characters, ending before the first stop string
    (`HeldText`: characters that could begin one wait until they cannot), a newline at the end."""

    def __init__(self, console: Console, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.console, self.text, self.held = console, IncrementalText(tokenizer), HeldText(stops)
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # transformers' convention: the prompt comes first
            self.prompt_seen = True
            return
        self.text.push(value.flatten().tolist())
        self.show(self.held.release(self.text.text))

    def end(self) -> None:
        self.text.finish()
        self.show(self.held.release(self.text.text, final=True))
        self.console.print()

    def show(self, piece: str) -> None:
        if piece:
            self.console.print(piece, end="", markup=False, highlight=False, soft_wrap=True)


def chat_loop(
    spec: RunSpec, model, tokenizer, draft, max_new_tokens: int, console: Console, options: dict | None = None
) -> None:
    """Read lines, answer each with the whole conversation so far. `options`: every answer's generation options
    (e.g. {"do_sample": True, "temperature": 0.7}; none: greedy)."""
    method = spec.method
    decoders = {method: spec.decoder(model, tokenizer, draft)}
    history: list[dict] = []
    console.print(f"[bold]forerun chat[/] ({method}). /reset, /method NAME, /quit; Ctrl-C stops an answer.")
    while True:
        try:
            line = console.input("[bold blue]you>[/] ").strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return
        if line == "/reset":
            history.clear()
            console.print("history cleared")
            continue
        if line.startswith("/method"):
            name = line.partition(" ")[2].strip()
            try:
                if name not in decoders:  # the start method's knobs are its own: another method starts from defaults
                    decoders[name] = spec.decoder(model, tokenizer, draft, method=name, knobs={})
            except ValueError as error:
                console.print(str(error), style="red", markup=False, highlight=False)
                continue
            method = name
            console.print(f"method: {method}")
            continue
        try:  # a line that is not text (invalid UTF-8 on stdin reads as lone surrogates) never enters the history
            check_text("your message", line)
        except ValueError as error:
            console.print(f"{error}; not sent", style="red", markup=False, highlight=False)
            continue
        history.append({"role": "user", "content": line})
        answer = answer_once(decoders[method], history, max_new_tokens, console, options)
        if answer is None:  # the turn failed: the history stays as it was, so the next turn is not broken by it
            history.pop()
            continue
        history.append(answer)


def answer_once(
    decoder: Decoder, history: list[dict], max_new_tokens: int, console: Console, options: dict | None = None
) -> dict | None:
    """Stream one answer to `history` (`options`: `Decoder.generate`'s); its message for the history, or None when
    it failed (the error is shown). A reasoning model's thought goes into the message as `reasoning_content`, apart
    from its content, as a template that shows thoughts takes it (Qwen3's shows the last turn's, drops older ones):
    a thought whose marks the decoded text drops (Mistral's) would otherwise read as the answer's words."""
    stream = ConsoleStream(console, decoder.tokenizer)
    cancel = threading.Event()
    box: dict = {}

    def work() -> None:
        try:
            box["result"] = decoder.generate(
                list(history), max_new_tokens, streamer=stream, cancel=cancel, **(options or {})
            )
        except Exception as error:  # noqa: BLE001 - shown to the user, the chat goes on
            box["error"] = error

    # While answering, Ctrl-C only cancels this answer (a handler, so it cannot land mid-statement elsewhere).
    previous = signal.signal(signal.SIGINT, lambda signum, frame: cancel.set())
    try:
        console.print("[bold]bot>[/] ", end="")
        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.1)
    finally:
        signal.signal(signal.SIGINT, previous)
    if cancel.is_set():
        console.print("(stopped)", style="dim", highlight=False)
    if "error" in box:
        console.print(f"error: {box['error']}", style="red", markup=False, highlight=False)
        return None
    result = box["result"]
    console.print(f"[dim]{result.stats.summary()}[/]", highlight=False)
    thought = {} if result.reasoning is None else {"reasoning_content": result.reasoning}
    return {"role": "assistant", "content": result.content or "", **thought}
