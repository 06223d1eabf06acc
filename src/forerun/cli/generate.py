"""`forerun generate` and `forerun chat`."""

from __future__ import annotations

import typer

from forerun.cli.common import (
    CHAT_TEMPLATE,
    COMPILE,
    DEVICE,
    DRAFT,
    DTYPE,
    HEAD,
    KNOB,
    METHOD,
    MODEL,
    NODES,
    PACK,
    QUANTIZE,
    SAMPLE,
    TEMPERATURE,
    TEMPLATE_KWARGS,
    THREADS,
    TOP_K,
    TOP_P,
    app,
    console,
    legend,
    read_chat_template,
    run_spec,
    sampling,
    template_kwargs_of,
    use_chat_template,
    user_errors,
)


@app.command()
@user_errors
def generate(
    prompt: str = typer.Argument(..., help="The prompt text; - reads it from standard input (a file piped in)."),
    model: str = MODEL,
    method: str = METHOD,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message with the chat template."),
    suffix: str = typer.Option(
        None, "--suffix", help="Fill in the middle: the text after the gap (the prompt is the text before it)."
    ),
    stop: list[str] = typer.Option(
        [], "--stop", help="End the answer where this text appears (repeatable; the text shown ends before it)."
    ),
    do_sample: bool = SAMPLE,
    temperature: float = TEMPERATURE,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    seed: int = typer.Option(None, "--seed", help="With --sample: the same seed writes the same text."),
    json_object: bool = typer.Option(False, "--json", help="Answer one JSON object (OpenAI's json_object)."),
    json_schema: str = typer.Option(
        None, "--json-schema", help="A JSON schema file: answer JSON that matches it (OpenAI's json_schema)."
    ),
    tools: str = typer.Option(
        None, "--tools", help="A JSON file of OpenAI function tools: shown to the model; its calls print as JSON lines."
    ),
    tool_choice: str = typer.Option(
        "auto", "--tool-choice", help="With --tools: auto, required, none, or a function's name (one call of it)."
    ),
    chat_template: str = CHAT_TEMPLATE,
    chat_template_kwargs: str = TEMPLATE_KWARGS,
    knob: list[str] = KNOB,
    max_tree_nodes: int = NODES,
    threads: int = THREADS,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Colour tokens by origin and print stats."),
    draft_model: str = DRAFT,
    draft_head: str = HEAD,
    compile_buckets: bool = COMPILE,
    device: str = DEVICE,
    dtype: str = DTYPE,
    quantize: str = QUANTIZE,
    pack: str = PACK,
) -> None:
    """Generate text: greedy, identical to model.generate(do_sample=False), only sooner; with --sample, drawn from
    the model's own distribution (whatever drafted it, the same --seed writes the same text)."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if prompt == "-":
        prompt = standard_input()
    if not prompt.strip():
        raise ValueError("prompt is empty")
    options = sampling(do_sample, temperature, top_p, top_k, seed) | variables_of(chat_template_kwargs)
    response_format = format_of(json_object, json_schema)
    offered = tools_of(tools, tool_choice)
    template = read_chat_template(chat_template) if chat_template else None
    spec = run_spec(model, method, knob, device, dtype, threads, draft_model, max_tree_nodes, quantize, draft_head,
                    compile_buckets, pack)  # fmt: skip
    lm, tokenizer, draft = spec.load()
    if template is not None:
        use_chat_template(tokenizer, template)
    decoder = spec.decoder(lm, tokenizer, draft)
    prompt = prompt if suffix is None else infilled(tokenizer, prompt, suffix, chat)
    if offered:
        return print_calls(decoder.generate(prompt, max_new_tokens, chat=True, stop=tuple(stop), **offered, **options))
    from forerun.chat import AnswerStream, ConsoleStream  # imports torch: after the options are checked

    # the answer shows as it is written; -v: every token, coloured by where it came from, then the stats
    streamer = ConsoleStream(console, tokenizer) if verbose else AnswerStream(console, tokenizer, tuple(stop))
    shape = {"stop": tuple(stop), "response_format": response_format}
    result = decoder.generate(prompt, max_new_tokens, chat=chat, streamer=streamer, **shape, **options)
    if not verbose:
        return
    console.print(legend(decoder.plan.names))
    console.print(result.stats.summary(), highlight=False)
    console.print(f"accepted length per step: {dict(sorted(result.stats.accepted_hist.items()))}", highlight=False)


def infilled(tokenizer, prefix: str, suffix: str, chat: bool) -> str:
    """`--suffix`: the fill-in-the-middle prompt of the text before and after the gap, in the tokenizer's own marks
    (`forerun.fim`); a ValueError naming the option where it has none, or with --chat."""
    from forerun.checks import check_text
    from forerun.fim import fim_marks, infill_prompt

    marks = fim_marks(tokenizer)
    if marks is None:
        raise ValueError("--suffix: this model's tokenizer has no fill-in-the-middle tokens (<|fim_prefix|>, ...)")
    if chat:
        raise ValueError("--suffix fills in the middle of a text: give it without --chat")
    check_text("--suffix", suffix)
    return infill_prompt(marks, prefix, suffix)


def format_of(json_object: bool, json_schema: str | None) -> dict | None:
    """The response format `--json` or `--json-schema FILE` asks for (None: free text); a ValueError naming the
    option where the file is not a JSON object or both are given (checked before the model loads)."""
    import json
    from pathlib import Path

    from forerun.structured import check_response_format

    if json_object and json_schema:
        raise ValueError("give --json or --json-schema, not both")
    if not json_schema:
        return {"type": "json_object"} if json_object else None
    try:
        schema = json.loads(Path(json_schema).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise ValueError(f"--json-schema {json_schema}: not a readable JSON file ({error})") from None
    entry = {"name": Path(json_schema).stem or "schema", "schema": schema}
    try:
        return check_response_format({"type": "json_schema", "json_schema": entry})
    except ValueError as error:
        raise ValueError(f"--json-schema {json_schema}: {error}") from None


def tools_of(path: str | None, choice: str) -> dict:
    """The `tools` and `tool_choice` of `--tools FILE --tool-choice ...` ({} without a file), checked before the
    model loads; a ValueError naming the option otherwise."""
    import json
    from pathlib import Path

    from forerun.tool_specs import check_tool_choice, check_tools

    if not path:
        return {}
    try:
        tools = check_tools(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError, RecursionError) as error:
        raise ValueError(f"--tools {path}: {error}") from None
    try:
        return {"tools": tools, "tool_choice": check_tool_choice(choice, tools)}
    except ValueError as error:
        raise ValueError(f"--tool-choice: {error}") from None


def print_calls(result) -> None:
    """A tools answer: its content (where there is some), then each call as one JSON line."""
    import json

    if result.content:
        console.print(result.content, highlight=False, markup=False)
    for call in result.tool_calls or ():
        print(json.dumps({"name": call.name, "arguments": json.loads(call.arguments)}, ensure_ascii=False))


def standard_input() -> str:
    """The prompt piped in (`forerun generate - < notes.txt`): UTF-8 text (a byte order mark dropped), or a
    ValueError saying where it is not."""
    import sys

    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ValueError(f"standard input is not UTF-8 text (byte {error.start}: {data[error.start]:#04x})") from None


@app.command()
@user_errors
def chat(
    model: str = MODEL,
    method: str = METHOD,
    knob: list[str] = KNOB,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    do_sample: bool = SAMPLE,
    temperature: float = TEMPERATURE,
    top_p: float = TOP_P,
    top_k: int = TOP_K,
    seed: int = typer.Option(None, "--seed", help="With --sample: each answer draws from this seed."),
    threads: int = THREADS,
    draft_model: str = DRAFT,
    draft_head: str = HEAD,
    max_tree_nodes: int = NODES,
    compile_buckets: bool = COMPILE,
    device: str = DEVICE,
    dtype: str = DTYPE,
    quantize: str = QUANTIZE,
    pack: str = PACK,
    chat_template_kwargs: str = TEMPLATE_KWARGS,
) -> None:
    """Chat in the terminal: streaming answers, draft-accepted tokens coloured, a stats line per answer (greedy, or
    sampled with --sample)."""
    from forerun.chat import chat_loop

    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    options = sampling(do_sample, temperature, top_p, top_k, seed) | variables_of(chat_template_kwargs)
    spec = run_spec(model, method, knob, device, dtype, threads, draft_model, max_tree_nodes, quantize, draft_head,
                    compile_buckets, pack)  # fmt: skip
    lm, tokenizer, draft = spec.load()
    chat_loop(spec, lm, tokenizer, draft, max_new_tokens, console, options)


def variables_of(text: str) -> dict:
    """The generation option `--chat-template-kwargs` gives ({} without one)."""
    variables = template_kwargs_of(text)
    return {"chat_template_kwargs": variables} if variables else {}
