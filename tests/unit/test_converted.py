"""A GGUF file converted once and kept as a transformers folder (`forerun.converted`).

The cache's rules are checked with a stand-in conversion (a tiny random model and a word-level tokenizer, counted
each time it runs); the real embedded file checks that the kept folder loads the very model a conversion gives."""

from __future__ import annotations

import logging
import os
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

import forerun
from forerun import converted
from forerun.converted import INDEX_FILE, SOURCE_FILE, folder_for, load_gguf
from forerun.measured import config_shape

from tiny_models import VOCAB, tiny_model


class Conversions:
    """A stand-in for transformers' reading of a GGUF file: a seeded tiny model, counted."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.count = 0
        self.dtype = dtype

    def __call__(self):
        self.count += 1
        words = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
        words.pre_tokenizer = Whitespace()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w2")
        return tiny_model("llama").to(self.dtype), tokenizer


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "models" / "tiny.Q4_0.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF stand-in")  # never parsed: the conversion is a stand-in
    return path


def load(gguf: Path, cache: Path | None, conversions: Conversions):
    return load_gguf(gguf, conversions.dtype, "sdpa", cache, conversions)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    left, right = a.state_dict(), b.state_dict()
    return left.keys() == right.keys() and all(
        torch.equal(left[k], right[k]) and left[k].dtype == right[k].dtype for k in left
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_file_converts_once_then_loads_from_its_folder(gguf, tmp_path, dtype):
    conversions = Conversions(dtype)
    first, tokenizer = load(gguf, tmp_path / "cache", conversions)
    again, tokenizer_again = load(gguf, tmp_path / "cache", conversions)
    assert conversions.count == 1
    assert same_weights(first, again) and again.dtype == dtype
    assert tokenizer_again("w5 w7 w9").input_ids == tokenizer("w5 w7 w9").input_ids == [5, 7, 9]
    assert again.config.name_or_path == tokenizer_again.name_or_path == str(gguf.parent)  # as a conversion names
    assert [p.name for p in (tmp_path / "cache" / "converted").iterdir()] == [folder_for(gguf, dtype, "x").name]


def test_each_dtype_has_its_folder_and_another_file_its_own(gguf, tmp_path):
    cache = tmp_path / "cache"
    load(gguf, cache, Conversions(torch.float32))
    load(gguf, cache, Conversions(torch.bfloat16))
    other = gguf.with_name("other.gguf")
    other.write_bytes(b"GGUF stand-in")
    load(other, cache, Conversions(torch.float32))
    names = sorted(p.name for p in (cache / "converted").iterdir())
    assert len(names) == 3 and sum("bfloat16" in n for n in names) == 1 and sum("other" in n for n in names) == 1


def test_a_replaced_file_converts_again_over_its_folder(gguf, tmp_path):
    conversions, cache = Conversions(), tmp_path / "cache"
    load(gguf, cache, conversions)
    gguf.write_bytes(b"GGUF stand-in, another model")
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
    load(gguf, cache, conversions)
    load(gguf, cache, conversions)
    assert conversions.count == 2
    assert len(list((cache / "converted").iterdir())) == 1


def test_a_file_replaced_while_it_converts_converts_again_next_time(gguf, tmp_path):
    conversions, cache = Conversions(), tmp_path / "cache"

    def replaced_meanwhile():
        pair = conversions()
        if conversions.count == 1:
            gguf.write_bytes(b"GGUF stand-in, replaced while the old one converted")
            os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
        return pair

    load_gguf(gguf, torch.float32, "sdpa", cache, replaced_meanwhile)
    load_gguf(gguf, torch.float32, "sdpa", cache, replaced_meanwhile)
    load_gguf(gguf, torch.float32, "sdpa", cache, replaced_meanwhile)
    assert conversions.count == 2  # the kept folder said "the file as it was before": the new one converts once


def test_another_transformers_converts_again(gguf, tmp_path, monkeypatch):
    conversions, cache = Conversions(), tmp_path / "cache"
    load(gguf, cache, conversions)
    monkeypatch.setattr(converted.transformers, "__version__", "0.0.1")
    load(gguf, cache, conversions)
    assert conversions.count == 2


@pytest.mark.parametrize("damage", ["cut weights", "no weights", "bad config"])
def test_a_damaged_folder_is_converted_again(gguf, tmp_path, caplog, damage):
    conversions, cache = Conversions(), tmp_path / "cache"
    reference, _ = load(gguf, cache, conversions)
    folder = folder_for(gguf, torch.float32, cache)
    weights = folder / "model.safetensors"
    if damage == "cut weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no weights":
        weights.unlink()
    else:
        (folder / "config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="forerun.converted"):
        model, _ = load(gguf, cache, conversions)
    assert conversions.count == 2 and same_weights(model, reference)
    assert "does not load" in caplog.text and str(folder) in caplog.text
    load(gguf, cache, conversions)  # kept whole again
    assert conversions.count == 2


def test_a_folder_without_its_record_is_not_trusted(gguf, tmp_path):
    conversions, cache = Conversions(), tmp_path / "cache"
    load(gguf, cache, conversions)
    (folder_for(gguf, torch.float32, cache) / SOURCE_FILE).unlink()  # as a writer killed before its last file
    load(gguf, cache, conversions)
    assert conversions.count == 2


def test_no_cache_dir_converts_every_time_and_writes_nothing(gguf, tmp_path):
    conversions = Conversions()
    load(gguf, None, conversions)
    load(gguf, None, conversions)
    assert conversions.count == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["models"]


def test_too_little_disk_keeps_nothing_and_still_loads(gguf, tmp_path, monkeypatch, caplog):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(converted.shutil, "disk_usage", lambda _: usage(10**9, 10**9, 10**6))
    conversions, cache = Conversions(), tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="forerun.converted"):
        model, _ = load(gguf, cache, conversions)
    assert isinstance(model, torch.nn.Module) and "too little disk free" in caplog.text
    assert list((cache / "converted").iterdir()) == []


def test_a_cache_that_cannot_be_written_still_loads(gguf, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")  # as a read-only home would refuse the cache's folders
    conversions = Conversions()
    with caplog.at_level(logging.WARNING, logger="forerun.converted"):
        model, _ = load(gguf, blocked / "cache", conversions)
        load(gguf, blocked / "cache", conversions)
    assert isinstance(model, torch.nn.Module) and conversions.count == 2
    assert "was not kept" in caplog.text and "Not a directory" in caplog.text


@pytest.mark.parametrize("part", ["config", "tokenizer"])
def test_a_conversion_that_reads_back_otherwise_is_not_kept(gguf, tmp_path, monkeypatch, caplog, part):
    # As an architecture whose converted config or tokenizer a transformers folder does not hold whole would.
    if part == "config":
        read = converted.AutoConfig.from_pretrained

        def otherwise(folder, **kwargs):
            config = read(folder, **kwargs)
            config.rope_theta = 1.0
            return config

        monkeypatch.setattr(converted.AutoConfig, "from_pretrained", otherwise)
    else:
        read = converted.AutoTokenizer.from_pretrained

        def otherwise(folder, **kwargs):
            tokenizer = read(folder, **kwargs)
            tokenizer.chat_template = "{{ messages }}"
            return tokenizer

        monkeypatch.setattr(converted.AutoTokenizer, "from_pretrained", otherwise)
    conversions, cache = Conversions(), tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="forerun.converted"):
        model, _ = load(gguf, cache, conversions)
    assert isinstance(model, torch.nn.Module) and "was not kept" in caplog.text
    assert ("rope_theta" if part == "config" else "its tokenizer reads back otherwise") in caplog.text
    assert list((cache / "converted").iterdir()) == []


def test_a_failed_write_leaves_no_folder_half_written(gguf, tmp_path, monkeypatch, caplog):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", full_disk)
    conversions, cache = Conversions(), tmp_path / "cache"
    with caplog.at_level(logging.WARNING, logger="forerun.converted"):
        model, _ = load(gguf, cache, conversions)
    assert isinstance(model, torch.nn.Module) and "No space left" in caplog.text
    assert list((cache / "converted").iterdir()) == []


def test_a_conversion_another_process_kept_meanwhile_is_left_in_place(gguf, tmp_path):
    cache = tmp_path / "cache"
    folder = folder_for(gguf, torch.float32, cache)
    theirs = {}

    def converted_while_another_process_keeps_it():
        assert converted.keep(*Conversions()(), folder, converted.source_of(gguf))
        theirs["inode"] = (folder / "model.safetensors").stat().st_ino
        return Conversions()()

    load_gguf(gguf, torch.float32, "sdpa", cache, converted_while_another_process_keeps_it)
    assert (folder / "model.safetensors").stat().st_ino == theirs["inode"]  # not replaced under a reader
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # and nothing half-written left


def test_stale_half_written_folders_are_swept_and_fresh_ones_left(gguf, tmp_path):
    cache = tmp_path / "cache"
    stale = cache / "converted" / "tiny.Q4_0-float32-0123456789abcdef.partial-1-deadbeef"
    fresh = stale.with_name("tiny.Q4_0-float32-0123456789abcdef.partial-2-cafef00d")
    for folder in (stale, fresh):
        folder.mkdir(parents=True)
    os.utime(stale, (0, 0))
    load(gguf, cache, Conversions())
    assert not stale.exists() and fresh.exists()


@pytest.mark.real_model
def test_the_embedded_file_kept_loads_as_its_conversion(tmp_path):
    model, tokenizer = forerun.load_model("smollm2-135m", cache_dir=tmp_path, pack=False)  # converts, keeps
    kept, kept_tokenizer = forerun.load_model("smollm2-135m", cache_dir=tmp_path, pack=False)  # reads the folder
    assert same_weights(model, kept)
    assert config_shape(kept.config) == config_shape(model.config)  # the latency curve's key: the same curve
    assert kept.config.name_or_path == model.config.name_or_path
    assert kept.generation_config.to_diff_dict() == model.generation_config.to_diff_dict()
    chat = [{"role": "user", "content": "Add type hints to: def add(a, b): return a + b"}]
    text = Path(__file__).read_text()
    for tok in (tokenizer, kept_tokenizer):
        assert tok.eos_token_id == 2 and len(tok) == 49152
    assert kept_tokenizer(text).input_ids == tokenizer(text).input_ids
    templated = [tok.apply_chat_template(chat, tokenize=False) for tok in (tokenizer, kept_tokenizer)]
    assert templated[0] == templated[1] and "Add type hints" in templated[0]


@pytest.mark.real_model
def test_int4_reads_the_files_codes_through_the_kept_index(tmp_path, monkeypatch):
    from test_gguf_codes import same_int4

    from forerun.base import gguf_codes

    model, _ = forerun.load_model("smollm2-135m", quantize="int4", cache_dir=tmp_path)  # converts, keeps, indexes
    monkeypatch.setattr(gguf_codes, "read_places", lambda _: pytest.fail("the GGUF metadata was parsed again"))
    kept, _ = forerun.load_model("smollm2-135m", quantize="int4", cache_dir=tmp_path)
    assert same_int4(model, kept)
    (folder,) = (tmp_path / "converted").iterdir()  # int4 starts from the bf16 conversion, beside its index
    assert "bfloat16" in folder.name and (folder / INDEX_FILE).is_file()
