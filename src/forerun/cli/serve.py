"""`forerun serve`: the OpenAI-compatible server."""

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
    TEMPLATE_KWARGS,
    THREADS,
    app,
    console,
    freeze_start_up,
    read_chat_template,
    run_spec,
    template_kwargs_of,
    use_chat_template,
    user_errors,
)

HOST = typer.Option("127.0.0.1", "--host")
PORT = typer.Option(8000, "--port")
API_KEY = typer.Option(
    "", "--api-key", help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (all but /health)."
)
ALLOW_HOST = typer.Option(
    [],
    "--allow-host",
    help="Host header accepted (repeatable; '*' = any). Default: any with --api-key, "
    "else local names only (no DNS rebinding against a local server).",
)
CACHE = typer.Option("", "--cache", help="Trie file: loaded at start if present, saved at shutdown.")
MAX_TOKENS_LIMIT = typer.Option(1024, "--max-tokens-limit")
TIMEOUT = typer.Option(300.0, "--timeout", help="Per-request timeout in seconds, arrival to last token.")
MAX_QUEUE = typer.Option(
    64, "--max-queue", help="Most generations queued or running (sampled choices each count); beyond it: 429."
)
MAX_BATCH = typer.Option(8, "--max-batch", help="Requests decoded together (1 = one at a time).")
PREFIX_CACHE = typer.Option(
    None,
    "--prefix-cache",
    help="Tokens of KV kept for prompts that begin alike (system prompt, next turn); 0: off. Default: four of the "
    "model's contexts, within 1 GiB of keys and values",
)
PREFILL_CHUNK = typer.Option(
    256,
    "--prefill-chunk",
    help="Prompt tokens a joining request feeds between two steps of the running ones (a long prompt does not "
    "freeze the other streams); 0: whole prompts at once",
)
WARM_UP_TOKENS = typer.Option(
    2048,
    "--warm-up-tokens",
    help="On a GPU, capture every graph before serving, for texts (prompt + answer) of up to this many tokens, "
    "single rows and the batch's; 0: each at its first use, in some request's time",
)
SERVED_NAME = typer.Option(
    [],
    "--served-model-name",
    help="The name the API reports the model by (default: --model's value); repeat it to take more names in a "
    "request's model field (a client's own name for its model).",
)
REQUEST_METHODS = typer.Option(
    "any",
    "--request-methods",
    help="Methods a request may pick in its forerun.method besides --method: 'any', 'none', or a comma list "
    "(learned state stays per cache_salt either way).",
)


@app.command()
@user_errors
def serve(
    model: str = MODEL,
    method: str = METHOD,
    knob: list[str] = KNOB,
    host: str = HOST,
    port: int = PORT,
    api_key: str = API_KEY,
    allow_host: list[str] = ALLOW_HOST,
    cache: str = CACHE,
    max_tokens_limit: int = MAX_TOKENS_LIMIT,
    timeout: float = TIMEOUT,
    max_queue: int = MAX_QUEUE,
    max_batch: int = MAX_BATCH,
    prefix_cache: int | None = PREFIX_CACHE,
    prefill_chunk: int = PREFILL_CHUNK,
    warm_up_tokens: int = WARM_UP_TOKENS,
    request_methods: str = REQUEST_METHODS,
    served_model_name: list[str] = SERVED_NAME,
    threads: int = THREADS,
    draft_model: str = DRAFT,
    draft_head: str = HEAD,
    max_tree_nodes: int = NODES,
    device: str = DEVICE,
    dtype: str = DTYPE,
    quantize: str = QUANTIZE,
    pack: str = PACK,
    compile_buckets: bool = COMPILE,
    chat_template: str = CHAT_TEMPLATE,
    chat_template_kwargs: str = TEMPLATE_KWARGS,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, the Responses API, streaming,
    /metrics) and Anthropic's Messages API (/v1/messages, for its SDKs and Claude Code)."""
    import uvicorn

    from forerun.server import ServerConfig, create_app
    from forerun.server.lifecycle import GracefulServer
    from forerun.server.protocol import guarded_h11

    check_limits(port, max_tokens_limit, timeout, max_queue, max_batch, prefix_cache, prefill_chunk, warm_up_tokens)
    names = served_names(served_model_name, model)
    spec = run_spec(model, method, knob, device, dtype, threads, draft_model, max_tree_nodes, quantize, draft_head,
                    compile_buckets, pack)  # fmt: skip
    config = ServerConfig(
        model_name=names[0], aliases=tuple(names[1:]), method=spec.method, knobs=dict(spec.knobs),
        draft_head=spec.draft_head, api_key=api_key or None, cache_path=cache or None,
        max_tokens_limit=max_tokens_limit, request_timeout_s=timeout, allowed_hosts=tuple(allow_host) or None,
        max_queue=max_queue, max_batch=max_batch, prefix_cache_tokens=prefix_cache, prefill_chunk=prefill_chunk,
        warm_up_tokens=warm_up_tokens, request_methods=parse_request_methods(request_methods),
        max_tree_nodes=spec.max_tree_nodes, compile_buckets=spec.compile_buckets,
        chat_template_kwargs=template_kwargs_of(chat_template_kwargs),
    )  # fmt: skip
    template = read_chat_template(chat_template) if chat_template else None
    lm, tokenizer, draft = spec.load()
    if template is not None:
        use_chat_template(tokenizer, template)
    with console.status("preparing the server (latency curves measured once per model, dtype and device; graphs)"):
        app = create_app(lm, tokenizer, config, draft)  # a bad cache file or knob stops here, in one line
    told_at_start(tokenizer, lm, app.state.pool.prefixes.max_tokens)
    freeze_start_up()  # the model, its tokenizer and the captured graphs: no full collection walks them again
    # On SIGTERM/SIGINT: stop accepting, give open requests 5 s, answer those left with 503 (streams: an error
    # event and [DONE]); the trie is saved after. guarded_h11: uvicorn's h11 with a deadline for request heads and
    # a cap on connections (slowloris).
    settings = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5, http=guarded_h11()
    )
    GracefulServer(settings, drain=app.state.worker.shutdown).run()


def told_at_start(tokenizer, model, prefix_tokens: int) -> None:
    """What the server says before it listens: the tool calls and thoughts its chat template teaches, and its
    prefix cache."""
    from forerun.thoughts import thoughts_told
    from forerun.tool_specs import calls_taught

    console.print(f"tool calls: {calls_taught(tokenizer)}", markup=False)  # marks such as [TOOL_CALLS]
    console.print(f"thoughts: {thoughts_told(tokenizer)}", markup=False)
    console.print(f"prefix cache: {prefix_told(prefix_tokens, model)}", markup=False)


def prefix_told(tokens: int, model) -> str:
    """What `forerun serve` says at start of its prefix cache: how many tokens it keeps, and their keys' and values'
    size at most (`forerun.assembly.prefix_tokens`' reckoning).

    Example:
        >>> prefix_told(0, None), prefix_told(4096, model)      # doctest: +SKIP
        ('off', '4,096 tokens (at most 189 MB of keys and values)')
    """
    from forerun.assembly import kv_bytes_per_token

    if not tokens:
        return "off"
    held = tokens * kv_bytes_per_token(model)
    return f"{tokens:,} tokens (at most {held / 1e6:,.0f} MB of keys and values)"


def served_names(given: list[str], model: str) -> list[str]:
    """The names the API knows the model by: `--served-model-name`'s (each once, none empty), else `--model`'s.

    Example:
        >>> served_names([], "smollm2-135m"), served_names(["coder", "claude-haiku", "coder"], "/models/qwen")
        (['smollm2-135m'], ['coder', 'claude-haiku'])
    """
    names = list(dict.fromkeys(given)) or [model]
    if not all(name.strip() for name in names):
        raise typer.BadParameter("a served model name is empty", param_hint="--served-model-name")
    return names


def check_limits(
    port: int,
    max_tokens_limit: int,
    timeout: float,
    max_queue: int,
    max_batch: int,
    prefix_cache: int | None,
    prefill_chunk: int,
    warm_up_tokens: int,
) -> None:
    """Refuse, in one line naming them, serving limits no server could keep (checked before the model loads).

    Example:
        >>> try:
        ...     check_limits(0, 1024, 300.0, 64, 8, 4096, 256, 2048)
        ... except ValueError as error:
        ...     print(str(error)[:29])
        --port must be in [1, 65535],
    """
    if (
        not 1 <= port <= 65535
        or max_tokens_limit < 1
        or not 0 < timeout < float("inf")
        or min(max_queue, max_batch) < 1
        or min(prefix_cache or 0, prefill_chunk, warm_up_tokens) < 0
    ):
        raise ValueError(
            "--port must be in [1, 65535], --max-tokens-limit, --max-queue and --max-batch >= 1, --prefix-cache, "
            "--prefill-chunk and --warm-up-tokens >= 0 and --timeout a positive number"
        )


def parse_request_methods(text: str) -> tuple[str, ...] | None:
    """'any' -> None (every method), 'none' -> (), 'trie,prompt_lookup' -> those (each checked by name)."""
    from forerun.methods import METHODS

    if text.strip() == "any":
        return None
    names = tuple(name.strip() for name in text.split(",") if name.strip() and name.strip() != "none")
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise ValueError(f"--request-methods: unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    return names
