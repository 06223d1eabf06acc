"""One server's limits and defaults (`ServerConfig`), and what is read before serving: the trie cache file, the
model's own sampling defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from forerun.decoder import Decoder
from forerun.defaults import DEFAULT_METHOD
from forerun.server.decoders import DecoderPool
from forerun.server.pool import DEFAULT_PREFILL_CHUNK


@dataclass(frozen=True)
class ServerConfig:
    """Limits and defaults of one server."""

    model_name: str
    """The name the API reports the model by (`serve --served-model-name`'s first, else `--model`'s value)."""
    method: str = DEFAULT_METHOD
    knobs: dict = field(default_factory=dict)
    draft_head: str | None = None
    """The EAGLE-3 head folder for method eagle3 (and auto); None: requests cannot ask for eagle3."""
    api_key: str | None = None
    """Bearer token required on every endpoint but /health (None = open)."""
    cache_path: str | None = None
    """Trie file loaded at start (if present) and saved at shutdown (methods with a trie)."""
    max_tokens_limit: int = 1024
    default_max_tokens: int = 128
    max_body_bytes: int = 1_000_000
    body_timeout_s: float = 30.0
    """From a request's head to the end of its body; a slower body gets 408 and its connection closed (a client
    that sends a body a byte a minute must not hold a connection for ever; heads: `forerun.server.protocol`)."""
    request_timeout_s: float = 300.0
    """From the request's arrival to its last token (queueing included)."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header values accepted ('*': any). None: any with an API key, else local names only."""
    max_queue: int = 64
    """Most generations waiting or running (a request's sampled choices each count); one more gets 429 with
    Retry-After (backpressure)."""
    max_batch: int = 8
    """Most requests decoded together (continuous batching); 1 = one at a time, in arrival order."""
    prefix_cache_tokens: int | None = None
    """Tokens of KV kept for prompts that begin alike (system prompts, next turns), shared by every method; None:
    four of the model's contexts within 1 GiB of keys and values (`forerun.assembly.prefix_tokens`); 0: off."""
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    """Prompt tokens a request joining the running batch feeds between two of its steps; 0: whole prompts at once
    (a long prompt then stops every other stream for its whole prefill)."""
    warm_up_tokens: int = 2048
    """Texts (prompt and answer) of up to this many tokens find the static cache's graphs captured before the first
    request (a GPU's: every bucket, for single rows and for the batch's rows; `Decoder.warm_up`), capped at the
    model's context; 0: each graph is captured at its first use, in some request's time."""
    compile_buckets: bool = False
    """A CUDA device's tree sizes compiled before their graphs are captured (`serve --compile-buckets`): shorter
    steps, minutes of compiling in the warm-up at start, once per process."""
    max_tree_nodes: int | None = None
    """Most tokens any request's forward may carry (`serve --max-tree-nodes`); None: what the curve affords."""
    aliases: tuple[str, ...] = ()
    """Other names a request's `model` may give it (`serve --served-model-name`'s others: a client's own name
    for its model, such as the one Claude Code asks for its quick tasks); `/v1/models` lists them too."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Variables given to the chat template for every chat request (`serve --chat-template-kwargs`: Qwen3's
    `{"enable_thinking": false}`); a request's own `chat_template_kwargs` override them by name. Each must be one the
    template reads (`forerun.template_kwargs`), checked before serving."""
    request_methods: tuple[str, ...] | None = None
    """Methods a request may name in `forerun.method` besides the server's own (None: any). State learned from
    requests (the trie, the n-gram pool) is kept per `cache_salt` whatever is allowed; `()` keeps every request on
    the operator's method and knobs' method."""


class CacheError(ValueError):
    """The cache file cannot be used: the message says why and what to do."""


def load_trie_cache(pool: DecoderPool, path: str | None) -> Decoder | None:
    """The Decoder whose trie the cache holds, with the file loaded if present; checked before serving."""
    if not path:
        return None
    decoder = pool.trie_decoder()
    if decoder is None:
        raise CacheError(f"--cache {path}: method {pool.method!r} keeps no trie (use a method with 'trie' in it)")
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise CacheError(f"--cache {path}: folder {folder} does not exist or is not writable")
    probe = folder / f".{Path(path).name}.probe-{os.getpid()}"
    try:  # a write, not a permission bit, tells whether the trie can be saved there at shutdown (/proc lies)
        probe.write_bytes(b"forerun")
        probe.unlink()
    except OSError as error:
        raise CacheError(f"--cache {path}: cannot write in {folder} ({error.strerror or error})") from None
    if Path(path).exists():
        try:
            decoder.load_cache(path)
        except (ValueError, OSError) as error:
            raise CacheError(f"--cache {path} cannot be read ({error}); delete it or give another path") from None
    return decoder


def sampling_defaults(model) -> dict:
    """The model's generation_config sampling settings, for the fields a request leaves out."""
    config = model.generation_config
    if not getattr(config, "do_sample", False):
        return {}
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {"do_sample": True, **{n: getattr(config, n) for n in names if getattr(config, n, None) is not None}}
