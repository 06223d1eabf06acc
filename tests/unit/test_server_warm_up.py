"""A server captures its graphs before its first request: the server's own method, its batch's rows (single rows
where it does not batch), for texts of `warm_up_tokens` (capped at the model's context); 0 leaves each capture to
its first use."""

from __future__ import annotations

import pytest

import forerun
from forerun.server import ServerConfig
from forerun.server.service import Service

from tiny_models import tiny_model


@pytest.mark.parametrize(("config", "expected"), [
    (ServerConfig("tiny", "prompt_lookup", max_batch=4, warm_up_tokens=100), [(100, 4)]),
    (ServerConfig("tiny", "prompt_lookup", max_batch=1, warm_up_tokens=100), [(100, 1)]),
    (ServerConfig("tiny", "prompt_lookup", max_batch=4, warm_up_tokens=10**6), [("context", 4)]),
    (ServerConfig("tiny", "prompt_lookup", max_batch=4, warm_up_tokens=0), []),
])  # fmt: skip
def test_the_server_warms_its_own_method_for_its_batch_before_serving(config, expected, monkeypatch):
    model = tiny_model("llama", "sdpa")
    calls = []
    original = forerun.Decoder.warm_up

    def spy(self, max_len=2048, batch_size=1, single=True):
        calls.append((self.method, max_len, batch_size, single))
        return original(self, max_len, batch_size, single) + 1.5  # a CPU has no static cache: 0.0 seconds of its own

    monkeypatch.setattr(forerun.Decoder, "warm_up", spy)
    service = Service(model, None, config)
    try:
        context = model.config.max_position_embeddings
        # a batched server's requests all join its batch: only its rows' graphs
        want = [("prompt_lookup", context if n == "context" else n, rows, rows == 1) for n, rows in expected]
        assert calls == want
        assert service.warm_up_s == (1.5 if expected else 0.0)
    finally:
        service.shutdown()


def test_a_server_whose_graphs_cannot_be_warmed_still_starts(monkeypatch, caplog):
    """A text as long as `warm_up_tokens` may not fit the static cache (a sliding window shorter than it): the
    server starts anyway, each graph then captured at its first use, and says why."""
    model = tiny_model("llama", "sdpa")

    def refused(self, max_len=2048, batch_size=1, single=True):
        raise ValueError("this model cannot verify trees on the static cache: a window of 1024 tokens")

    monkeypatch.setattr(forerun.Decoder, "warm_up", refused)
    service = Service(model, None, ServerConfig("tiny", "prompt_lookup", max_batch=4, warm_up_tokens=100))
    try:
        assert service.warm_up_s == 0.0
        assert "no graphs captured before serving" in caplog.text and "window of 1024" in caplog.text
    finally:
        service.shutdown()


def test_serve_compile_buckets_compiles_the_servers_own_decoder_only():
    """`forerun serve --compile-buckets` (a card's: a CPU refuses it at the command line) reaches the Decoder of the
    server's own method and knobs, warmed at start; one a request asks for (another method, other knobs) runs on
    captured graphs, since compiling in a request's time (minutes on a card) would hold every other stream."""
    config = ServerConfig("tiny", "prompt_lookup", warm_up_tokens=0, compile_buckets=True)
    service = Service(tiny_model("llama", "sdpa"), None, config)
    try:
        own, tuned = service.pool.get("prompt_lookup", {}), service.pool.get("prompt_lookup", {"draft_len": 3})
        other = service.pool.get("trie", {})
        assert own.engine_config.compile_buckets
        assert not tuned.engine_config.compile_buckets and not other.engine_config.compile_buckets
    finally:
        service.shutdown()
