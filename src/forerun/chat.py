"""`forerun chat`: an interactive terminal chat on one Decoder, streaming, tokens coloured by origin.

Commands: /reset (clear the history), /method NAME (switch drafting method), /quit. Ctrl-C stops the answer being
written, not the program; Ctrl-D or /quit leaves.
"""

from __future__ import annotations

import signal
import threading

from rich.console import Console

from forerun.config import check_method
from forerun.decoder import Decoder

SOURCE_STYLES = {
    "model": "",
    "prompt_lookup": "bold green",
    "jacobi": "bold cyan",
    "trie": "bold magenta",
    "draft_model": "bold yellow",
}


class ConsoleStream:
    """Prints each committed token as it arrives, styled by where it came from."""

    def __init__(self, console: Console, tokenizer) -> None:
        self.console, self.tokenizer = console, tokenizer
        self.ids: list[int] = []
        self.pending_sources: list[str] = []
        self.printed = ""
        self.prompt_seen = False

    def note_sources(self, sources: list[str]) -> None:
        self.pending_sources = list(sources)

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token, source in zip(
            value.flatten().tolist(), self.pending_sources or ["model"] * value.numel(), strict=False
        ):
            self.ids.append(token)
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            self.console.print(
                text[len(self.printed) :],
                style=SOURCE_STYLES.get(source, "bold yellow"),
                end="",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            self.printed = text
        self.pending_sources = []

    def end(self) -> None:
        self.console.print()


def chat_loop(model, tokenizer, method: str, knobs: dict, max_new_tokens: int, console: Console) -> None:
    decoders = {method: Decoder(model, tokenizer, method, **knobs)}
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
                check_method(name)
            except ValueError as error:
                console.print(str(error), style="red", markup=False, highlight=False)
                continue
            decoders.setdefault(name, Decoder(model, tokenizer, name))
            method = name
            console.print(f"method: {method}")
            continue
        history.append({"role": "user", "content": line})
        answer = answer_once(decoders[method], history, max_new_tokens, console)
        history.append({"role": "assistant", "content": answer})


def answer_once(decoder: Decoder, history: list[dict], max_new_tokens: int, console: Console) -> str:
    stream = ConsoleStream(console, decoder.tokenizer)
    cancel = threading.Event()
    box: dict = {}

    def work() -> None:
        try:
            box["result"] = decoder.generate(list(history), max_new_tokens, streamer=stream, cancel=cancel)
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
        return ""
    result = box["result"]
    console.print(f"[dim]{result.stats.summary()}[/]", highlight=False)
    return result.text or ""
