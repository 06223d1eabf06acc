"""Method expressions: the registry, '+' combinations, 'auto', dotted knobs, and every bad input named."""

import pytest
from typer.testing import CliRunner

import forerun
from forerun.cli import app
from forerun.config import JacobiConfig, PromptLookupConfig, TrieConfig
from forerun.methods import REGISTRY, parse_method, plan_method, source_style

from tiny_models import tiny_model


def test_registry_declares_every_method_once():
    assert list(REGISTRY) == ["prompt_lookup", "trie", "jacobi", "draft_model", "eagle3"]
    for name, spec in REGISTRY.items():
        assert spec.name == name and spec.about and spec.style and spec.budget(spec.config()) >= 1
    assert [s.name for s in parse_method("auto")] == ["prompt_lookup", "trie", "jacobi"]  # model-free only
    assert source_style("trie") == "bold magenta" and source_style("model") == "" and source_style("decoy")


def test_combinations_keep_the_written_order_and_route_dotted_knobs():
    plan = plan_method(" trie + prompt_lookup ", {"trie.decoding_length": 20, "prompt_lookup.max_branches": 3})
    assert plan.names == ("trie", "prompt_lookup") and plan.combined
    assert plan.config("trie") == TrieConfig(decoding_length=20)
    assert plan.config("prompt_lookup") == PromptLookupConfig(max_branches=3)
    assert plan.static_budget() == 1 + 20 + 15
    single = plan_method("jacobi", {"window": 2, "jacobi.ngram": 3})  # one method: dotted or not
    assert single.configs == (JacobiConfig(window=2, ngram=3),) and not single.combined
    assert plan_method("plain").specs == ()


@pytest.mark.parametrize(
    ("method", "knobs", "message"),
    [
        ("trie+medusa", {}, "unknown method 'medusa' in 'trie\\+medusa'"),
        ("trie+trie", {}, "method 'trie' appears twice in 'trie\\+trie'"),
        ("auto+jacobi", {}, "appears twice in 'auto\\+jacobi' \\(it is part of 'auto'\\)"),
        ("plain+trie", {}, "'plain' means no drafter and cannot be combined"),
        ("", {}, "method must be a name"),
        ("trie+", {}, "unknown method '' in 'trie\\+'"),
        ("auto", {"draft_len": 3}, "knob 'draft_len' needs a method prefix when several methods are combined"),
        ("prompt_lookup+trie", {"jacobi.window": 2}, "knob 'jacobi.window' is for method 'jacobi', which is not part"),
        ("auto", {"trie.window": 2}, "unknown knob\\(s\\) \\['window'\\] for method 'trie'"),
        ("auto", {"trie.decoding_length": 0}, "decoding_length must be an integer >= 1 and <= 1024, got 0"),
        # every knob has a ceiling: a request's knobs build a server-side Decoder
        ("jacobi", {"window": 100_000}, "window must be an integer >= 1 and <= 64, got 100000"),
        ("jacobi", {"window": 64, "ngram": 32}, r"window x \(ngram - 1\) must be <= 1024 probe tokens, got 64 x 31"),
        ("trie", {"output_weight": float("inf")}, "output_weight must be a number >= 0 and <= 1e\\+06, got inf"),
        ("trie", {"prompt_weight": float("nan")}, "prompt_weight must be a number >= 0 and <= 1e\\+06, got nan"),
        ("trie", {"prompt_weight": 1e308}, "prompt_weight must be a number >= 0 and <= 1e\\+06, got 1e\\+308"),
        ("prompt_lookup", {"draft_len": 10**30}, "draft_len must be an integer >= 1 and <= 256"),
        ("eagle3", {"catch_up": 10**12}, "catch_up must be an integer >= 0 and <= 4096, got 1000000000000"),
        ("auto+eagle3", {"eagle3.catch_up": -1}, "catch_up must be an integer >= 0 and <= 4096, got -1"),
        ("eagle3", {"catch_up": True}, "catch_up must be an integer >= 0 and <= 4096, got True"),
        ("plain", {"draft_len": 3}, "method 'plain' takes no knobs"),
    ],
)
def test_bad_expressions_and_knobs_raise_value_errors_naming_them(method, knobs, message):
    with pytest.raises(ValueError, match=message):
        plan_method(method, knobs)


def test_a_flat_latency_curve_widens_the_default_proposals_and_nothing_else():
    """On a flat curve (extra tokens nearly free) the cost model gets wider proposals to choose from; knobs the
    caller gives, static budgets and steep curves keep the CPU defaults."""
    model = tiny_model("llama")
    flat, steep = forerun.LatencyCurve((1, 16), (0.010, 0.012)), forerun.LatencyCurve((1, 16), (0.010, 0.025))
    wide = forerun.Decoder(model, None, "auto", latency=flat, **{"trie.branch_length": 10})
    assert wide.plan.config("trie") == TrieConfig(decoding_length=64, branch_length=10)  # the caller's knob wins
    assert wide.plan.config("prompt_lookup") == PromptLookupConfig(max_branches=8, draft_len=16)
    assert wide.plan.config("jacobi") == JacobiConfig(max_candidates=7)
    assert [d.config for d in wide.drafters] == list(wide.plan.configs)  # the drafters are built from it
    assert forerun.Decoder(model, None, "auto", latency=steep).plan.configs == plan_method("auto").configs
    static = forerun.Decoder(model, None, "trie", latency=flat, adaptive=False)
    assert static.plan.config("trie") == TrieConfig()


def test_decoder_reports_and_rejects_like_the_plan():
    model = tiny_model("llama")
    curve = forerun.LatencyCurve((1, 16), (1.0, 1.2))
    decoder = forerun.Decoder(model, None, "auto", latency=curve, **{"trie.decoding_length": 6})
    assert decoder.method == "auto" and decoder.config is None and len(decoder.drafters) == 3
    assert type(decoder.budget).__name__ == "CostModel" and decoder.budget.max_nodes == 16  # the curve's cap
    static = forerun.Decoder(model, None, "prompt_lookup+trie", adaptive=False)
    assert type(static.budget).__name__ == "StaticBudget" and static.budget.max_nodes == 1 + 15 + 12
    with pytest.raises(ValueError, match="draft_model is a knob of method 'draft_model'"):
        forerun.Decoder(model, None, "auto", draft_model=model)
    with pytest.raises(ValueError, match="EngineConfig.adaptive must be true or false"):
        forerun.Decoder(model, None, "auto", adaptive="yes")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--method", "trie+nope"], "unknown method 'nope' in 'trie+nope'"),
        (["generate", "hi", "--method", "auto", "--knob", "draft_len=3"], "needs a method prefix"),
        (["generate", "hi", "--method", "trie", "--knob", "jacobi.window=3"], "is for method 'jacobi'"),
        (["generate", "hi", "--dtype", "fp64"], "dtype must be one of fp32, bf16, fp16"),
        (["generate", "hi", "--threads", "100000"], "threads must be an integer in [0, 1024]"),
        (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["generate", "hi", "--method", "draft_model"], "method draft_model needs a draft model"),
        (["bench", "--methods", "auto[draft_len=3]"], "needs a method prefix"),
        (["curve", "--dtype", "fp32,int3"], "dtype must be one of"),
        (["curve", "--rows", "1,4"], "--rows must be between 2 and 256"),
        (["curve", "--rows", "two"], "--rows must be comma-separated integers"),
        (["generate", "hi", "--device", "cuda"], "this machine has no CUDA device"),
        (["generate", "hi", "--device", "tpu:0"], "device"),
        (["serve", "--port", "0"], "--port must be in [1, 65535]"),
    ],
)
def test_cli_refuses_bad_methods_in_one_line_before_loading(args, message):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
