"""EAGLE-3 heads in SpecForge's layout: written by hand here, loaded and checked against the target."""

from __future__ import annotations

import pytest
import torch

import forerun
from forerun.drafters.eagle3 import HeadCache, load_head

from eagle3_heads import DRAFT_VOCAB, write_head
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"fc_norm": True},
        {"norm_output": False},
        {"own_embedding": True},
        {"own_embedding": True, "hidden": 32},
        {"aux": [0, 1, 1]},
    ],
)
def test_a_head_in_specforge_layout_loads_and_drafts(tmp_path, target, options):
    state = write_head(tmp_path, target, **options)
    head = load_head(tmp_path, target, dtype=torch.float32)
    assert torch.equal(head.fc.weight, state["fc.weight"]) and torch.equal(head.d2t, state["d2t"])
    assert (head.fc_norm is not None) == options.get("fc_norm", False)
    assert head.norm_output == options.get("norm_output", True)
    assert (head.embed_tokens is target.get_input_embeddings()) != options.get("own_embedding", False)
    assert head.aux_layers == tuple(options.get("aux", [1, 0, 0]))  # a 2-layer target: the defaults clamped
    features = torch.randn(4, 3 * target.config.hidden_size)
    cache = HeadCache()
    with torch.inference_mode():
        out = head(torch.tensor([3, 4, 5, 6]), head.project(features), torch.arange(4), cache)
        logits = head.draft_logits(out)
    assert out.shape == (4, options.get("hidden", 64)) and logits.shape == (4, DRAFT_VOCAB) and cache.length == 4
    assert head.target_ids(torch.tensor([0, 1, DRAFT_VOCAB - 1])).tolist() == [0, 2, 2 * DRAFT_VOCAB - 2]


def test_the_cache_makes_one_position_at_a_time_equal_all_at_once(tmp_path, target):
    write_head(tmp_path, target)
    head = load_head(tmp_path, target, dtype=torch.float32)
    tokens, hidden = torch.tensor([3, 4, 5]), torch.randn(3, 64)
    with torch.inference_mode():
        together = head(tokens, hidden, torch.arange(3), HeadCache())
        cache = HeadCache()
        apart = torch.cat([head(tokens[i : i + 1], hidden[i : i + 1], torch.arange(i, i + 1), cache) for i in range(3)])
        # the negative control: without its cache the last position sees only itself
        alone = head(tokens[2:], hidden[2:], torch.arange(2, 3), HeadCache())
    torch.testing.assert_close(apart, together, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone, together[2:], atol=1e-3)


def test_a_bf16_head_under_an_fp32_target_leaves_the_target_as_it_is_and_drafts_exactly(tmp_path, target):
    """On a CPU with bf16 units a head computes in bf16 under an fp32 target; the embedding it shares stays the
    target's own, in fp32 (converting it would change what the target writes)."""
    import forerun
    from forerun.drafters.eagle3.load import head_dtype

    from tiny_models import prompts

    assert head_dtype(torch.float32, "cpu", bf16_units=True) == torch.bfloat16
    assert head_dtype(torch.float32, "cpu", bf16_units=False) == torch.float32
    assert head_dtype(torch.bfloat16, "cpu", bf16_units=True) == torch.bfloat16
    assert head_dtype(torch.float32, "cuda") == torch.float32
    write_head(tmp_path, target)
    before = target.get_input_embeddings().weight.clone()
    head = load_head(tmp_path, target, dtype=torch.bfloat16)
    embedding = target.get_input_embeddings().weight
    assert head.embed_tokens is target.get_input_embeddings() and embedding.dtype == torch.float32
    assert torch.equal(embedding, before)
    assert head.fc.weight.dtype == head.lm_head.weight.dtype == torch.bfloat16
    assert head.rotary.inv_freq.dtype == torch.float32
    prompt = prompts(1)[0]
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    result = forerun.Decoder(target, None, "eagle3", draft_head=head, adaptive=False).generate(
        prompt, 24, eos_token_id=[]
    )
    assert torch.equal(result.sequences, expected) and result.stats.candidates > 0


def test_on_a_cpu_a_bf16_head_over_a_dense_target_reads_int4_weights(tmp_path, target):
    """On a CPU a head's forward costs about the bytes it reads: computing in bf16, it loads with int4 weights over
    a dense target (the bf16 tensors of `quantized=False` read over 3x more). An fp32 head stays dense (torchao's
    int4 products compute in bf16)."""
    pytest.importorskip("torchao")
    from forerun.base.weights import read_bytes, weights_kind

    from tiny_models import prompts

    write_head(tmp_path, target)
    small, dense = load_head(tmp_path, target, torch.bfloat16), load_head(tmp_path, target, torch.bfloat16, False)
    assert weights_kind(small) == "int4" and weights_kind(dense) is None
    assert weights_kind(load_head(tmp_path, target, dtype=torch.float32)) is None
    skip = (target.get_input_embeddings(),)  # looked up, not read
    assert read_bytes(small, skip) < 0.35 * read_bytes(dense, skip)  # (its 40-row output matrix stays dense)
    decoder = forerun.Decoder(target, None, "eagle3", draft_head=small, adaptive=False)
    result = decoder.generate(prompts(1)[0], 24, eos_token_id=[])
    expected = target.generate(prompts(1)[0], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(result.sequences, expected) and result.stats.candidates > 0


def test_what_a_target_forward_reads_leaves_out_an_embedding_only_looked_up():
    """What a forward reads of its weights (what int4 weights save): an input embedding apart from the output
    matrix is only looked up (left out); tied to it, it is read (kept)."""
    from forerun.base.weights import looked_up, read_bytes

    model = tiny_model("qwen2")
    embedding = model.get_input_embeddings()
    size = embedding.weight.numel() * embedding.weight.element_size()
    assert looked_up(model) == (embedding,)
    assert read_bytes(model, looked_up(model)) == read_bytes(model) - size
    model.get_output_embeddings().weight = embedding.weight  # tied
    assert looked_up(model) == () and read_bytes(model, looked_up(model)) == read_bytes(model)


def drop(key):
    return lambda state: state.pop(key)


@pytest.mark.parametrize(
    ("edit_config", "edit_state", "file", "key"),
    [
        (lambda r: r.update(architectures=["LlamaForCausalLM"]), None, "config.json", "architectures"),
        (lambda r: r.update(target_hidden_size=32), None, "config.json", "target_hidden_size"),
        (lambda r: r.update(vocab_size=1000), None, "config.json", "vocab_size"),
        (lambda r: r.pop("draft_vocab_size"), None, "config.json", "draft_vocab_size"),
        (
            lambda r: r.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}),
            None,
            "config.json",
            "eagle_aux_hidden_state_layer_ids",
        ),
        (None, drop("norm.weight"), "model.safetensors", "norm.weight"),
        (None, drop("midlayer.self_attn.q_proj.weight"), "model.safetensors", "midlayer.self_attn.q_proj.weight"),
        (None, lambda s: s.update({"fc.weight": torch.zeros(64, 100)}), "model.safetensors", "fc.weight"),
        (None, lambda s: s.update({"extra.weight": torch.zeros(2)}), "model.safetensors", "extra.weight"),
        (None, lambda s: s["d2t"].__setitem__(0, 10_000), "model.safetensors", "d2t"),
        (None, lambda s: s["t2d"].__setitem__(1, True), "model.safetensors", "t2d"),
    ],
)
def test_a_malformed_head_is_refused_naming_the_file_and_key(tmp_path, target, edit_config, edit_state, file, key):
    write_head(tmp_path, target, edit_config=edit_config, edit_state=edit_state)
    with pytest.raises(ValueError, match=rf"{file}: .*{key}"):
        load_head(tmp_path, target)


def test_a_narrow_head_without_its_own_embedding_is_refused(tmp_path, target):
    write_head(tmp_path, target, hidden=32)
    with pytest.raises(ValueError, match=r"model.safetensors: embed_tokens.weight: missing"):
        load_head(tmp_path, target)


def test_a_folder_without_a_head_is_refused(tmp_path, target):
    with pytest.raises(FileNotFoundError):
        load_head(tmp_path / "nowhere", target)
    with pytest.raises(ValueError, match="config.json: missing"):
        load_head(tmp_path, target)
    write_head(tmp_path, target)
    (tmp_path / "model.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(ValueError, match="cannot read it as safetensors"):
        load_head(tmp_path, target)


def test_the_servers_pool_and_the_run_specification_take_a_head(tmp_path, target):
    from forerun.runspec import RunSpec
    from forerun.server.decoders import DecoderPool

    write_head(tmp_path, target)
    pool = DecoderPool(target, None, "auto", {}, draft_head=str(tmp_path))
    assert "eagle3" in pool.get("auto", {}).plan.names and "eagle3" in pool.get("eagle3", {}).plan.names
    with pytest.raises(ValueError, match="--draft-head"):
        DecoderPool(target, None, "auto", {}).get("eagle3", {})
    assert RunSpec(method="auto", draft_head=str(tmp_path)).plan().names[-1] == "eagle3"
    with pytest.raises(ValueError, match="--draft-head"):
        RunSpec(method="eagle3")
    with pytest.raises(ValueError, match="not part of 'trie'"):
        RunSpec(method="trie", draft_head=str(tmp_path))


def test_the_head_auto_adds_takes_its_knobs_at_every_entry_point_and_none_without_a_head(tmp_path, target):
    """Given a head, 'auto' drafts with it, so 'eagle3.catch_up=0' under 'auto' sets the head it adds: in a Decoder,
    a run specification, the server's pool and its request check, and the benchmark. Without a head the same knob
    is refused, saying a head must be given: nothing would read it."""
    from forerun.bench.methods import parse_methods
    from forerun.runspec import RunSpec
    from forerun.server.decoders import DecoderPool
    from forerun.server.schemas import CompletionRequest
    from forerun.server.translate import APIError, Limits, translate

    write_head(tmp_path, target)
    knob = {"eagle3.catch_up": 0}
    decoder = forerun.Decoder(target, None, "auto", draft_head=str(tmp_path), **knob)
    assert decoder.method == "auto+eagle3" and decoder.drafters[-1].config.catch_up == 0
    assert RunSpec(method="auto", knobs=knob, draft_head=str(tmp_path)).plan().config("eagle3").catch_up == 0
    pool = DecoderPool(target, None, "auto", knob, draft_head=str(tmp_path))
    assert pool.get("auto", {}).drafters[-1].config.catch_up == 0
    assert pool.get("auto", {"eagle3.catch_up": 5}).drafters[-1].config.catch_up == 5
    (method,) = parse_methods("auto[eagle3.catch_up=0]")
    assert method.reads_head(True) and method.knobs == knob
    served, bare = Limits("m", method="auto", head=True), Limits("m", method="auto")
    body = CompletionRequest(prompt="hi", forerun={"method": "auto", "eagle3.catch_up": 3})
    assert translate(body, served).knobs == {"eagle3.catch_up": 3}

    without = "'auto' drafts with a head only when one is given"
    with pytest.raises(ValueError, match=without):
        forerun.Decoder(target, None, "auto", **knob)
    with pytest.raises(ValueError, match=without):
        RunSpec(method="auto", knobs=knob)
    with pytest.raises(ValueError, match=without):
        DecoderPool(target, None, "auto", {}).get("auto", knob)
    with pytest.raises(ValueError, match=without):
        method.reads_head(False)
    with pytest.raises(APIError, match=without):
        translate(body, bare)


def test_the_heads_attention_keeps_off_cudnn_on_a_card_and_changes_nothing_elsewhere(tmp_path, target, monkeypatch):
    """cuDNN's attention plans every new shape on the host, and the head's shapes change every step: on a CUDA
    device the head's attention runs with cuDNN's backend switched off (torch's scoped switch), and the switch is
    restored after it. On a CPU nothing is switched."""
    from forerun.drafters.eagle3 import head as head_module

    with head_module.planless_attention(torch.device("cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with head_module.planless_attention(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()
    # Every attention call of the head goes through the switch, with the device its inputs are on.
    asked, real = [], head_module.planless_attention
    monkeypatch.setattr(head_module, "planless_attention", lambda device: asked.append(device) or real(device))
    write_head(tmp_path, target)
    head = load_head(tmp_path, target, dtype=torch.float32)
    with torch.inference_mode():
        head(torch.tensor([5, 6]), head.project(torch.randn(2, 3 * target.config.hidden_size)), torch.arange(2),
             HeadCache())  # fmt: skip
    assert asked == [torch.device("cpu")]
