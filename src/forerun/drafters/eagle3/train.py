"""Train an EAGLE-3 head for a target on this machine: teacher-forced on the target's own hidden states and
next-token distributions, written in SpecForge's export layout (so SGLang and SpecForge can load it too).

Each chunk of text is read once by the target (no gradient), which gives its three auxiliary layers' outputs and its
next-token distribution at every position. The head reads position i's features with the token after it and is
trained to put the target's own distribution at position i + 1 (over the draft vocabulary, renormalised) on what
comes after that: the cross-entropy between the two. The draft vocabulary is the `draft_vocab` tokens the target
itself predicts most often on the training text; the head's output matrix starts as the target's own rows for
them, its embedding is the target's (not written), the rest starts at random.

Deeper levels of the draft tree feed the head its own output in place of the target's features (it has none for
unverified tokens), so the head is also trained that way (EAGLE-3's training-time test, `TrainConfig.unroll`): step
s reads, at each position, the token s places ahead with the head's step s-1 output there, sees the target's
positions up to its chain's start and its own chain's entries, and is trained on the target's distribution s
places ahead. The steps' losses are summed with weights 0.8^(s-1), as SpecForge weighs them.

The text is read again from its start while the time lasts (a small corpus of the model's own answers, several
times).

Example:
    >>> folder = train_head(model, tokenizer, texts, "heads/smollm2", TrainConfig(seconds=1800))   # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from forerun.drafters.eagle3.head import Eagle3Head, HeadCache, default_aux_layers, head_config


@dataclass(frozen=True)
class TrainConfig:
    draft_vocab: int = 8192
    """Tokens the head can propose (the target's most frequent predictions on the training text)."""
    chunk: int = 256
    """Tokens per training chunk (one target forward, one head step)."""
    seconds: float = 1800.0
    """Wall-clock budget for training (the vocabulary pass not counted)."""
    lr: float = 1e-3
    seed: int = 0
    vocab_chunks: int = 64
    """Chunks the draft vocabulary is counted on."""
    unroll: int = 1
    """Training-time test steps (module docstring): 1 trains the first level only; each more step costs about as
    much again and trains one more level on the head's own outputs."""


def stdlib_texts() -> list[str]:
    """The Python standard library's top-level source files, in name order: text on this machine that none of
    the benchmark's datasets or prompts contain (code and its docstrings)."""
    import sysconfig

    folder = Path(sysconfig.get_paths()["stdlib"])
    return [path.read_text(encoding="utf-8", errors="replace") for path in sorted(folder.glob("*.py"))]


def chunks_of(tokenizer, texts: Iterable[str], size: int) -> Iterator[torch.Tensor]:
    """The texts' tokens, concatenated (an end-of-text token between texts), in [1, size] chunks."""
    buffer: list[int] = []
    end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for text in texts:
        buffer.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + end)
        while len(buffer) >= size:
            yield torch.tensor([buffer[:size]])
            buffer = buffer[size:]


@torch.no_grad()  # not inference mode: the head's gradients go through these tensors
def target_reading(model, ids: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target on `ids` [1, T]: features [T, 3H] (its layers' outputs) and logits [T, vocab]."""
    from forerun.taps import LayerTaps

    with LayerTaps(model, layers) as taps:
        logits = model(ids).logits[0]
        features = taps.take()[0]
    return features, logits


def draft_vocabulary(model, chunks: list[torch.Tensor], size: int) -> torch.Tensor:
    """The `size` tokens the target predicts most often on `chunks` (its argmax at every position), sorted."""
    counts: Counter[int] = Counter()
    with torch.no_grad():
        for ids in chunks:
            counts.update(model(ids).logits[0].argmax(-1).tolist())
            counts.update(ids[0].tolist())
    vocab = model.get_output_embeddings().weight.shape[0]
    chosen = [token for token, _ in counts.most_common(size)]
    chosen += [t for t in range(vocab) if t not in set(chosen)][: size - len(chosen)]
    return torch.tensor(sorted(chosen))


def new_head(model, used: torch.Tensor, layers: tuple[int, ...]) -> Eagle3Head:
    """A head shaped like one of the target's layers, over draft vocabulary `used` (target ids, sorted)."""
    config = model.config
    vocab = model.get_output_embeddings().weight.shape[0]
    head_conf = head_config(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, vocab,
                            len(used), config.hidden_size)  # fmt: skip
    head_conf.intermediate_size = config.intermediate_size
    head_conf.rope_theta = getattr(config, "rope_theta", 10000.0)
    head_conf.rms_norm_eps = config.rms_norm_eps
    head_conf.max_position_embeddings = config.max_position_embeddings
    head_conf.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(layers)}
    head = Eagle3Head(head_conf, model.get_input_embeddings(), layers).float()
    with torch.no_grad():
        head.lm_head.weight.copy_(model.get_output_embeddings().weight[used].float())
        head.d2t.copy_(used - torch.arange(len(used)))
        head.t2d.zero_()
        head.t2d[used] = True
    return head


def unrolled(head: Eagle3Head, ids: torch.Tensor, features: torch.Tensor, unroll: int) -> list[torch.Tensor]:
    """The head's outputs at each training-time test step on one chunk `ids` [1, T] with the target's `features`
    [T, 3H]: step s gives [T - s, H], row j the chain that starts at position j (module docstring)."""
    length, cache = ids.shape[1], HeadCache()
    hidden, outputs, starts = head.project(features[:-1].float()), [], []
    for step in range(1, min(unroll, length - 1) + 1):
        rows = length - step  # chains that reach this far
        positions = torch.arange(rows) + step - 1
        visible = None if step == 1 else chain_mask(rows, starts, length - 1)
        starts.append(cache.length)
        hidden = head(ids[0, step:], hidden[:rows], positions, cache, visible)
        outputs.append(hidden)
    return outputs


def train_step(head: Eagle3Head, optimizer, ids: torch.Tensor, features, logits, used, unroll: int = 1) -> float:
    """One step on one chunk [1, T]: step 1, the head at positions 0..T-2 (features g_i, token x_{i+1}) against
    the target's distributions at 1..T-1; step s, its step s-1 outputs with the tokens s places ahead, against
    the distributions s places ahead (module docstring)."""
    loss = 0.0
    for step, out in enumerate(unrolled(head, ids, features, unroll), start=1):
        target = torch.softmax(logits[step:, used].float(), dim=-1)  # the target's odds there, draft vocabulary
        loss = loss + 0.8 ** (step - 1) * -(target * torch.log_softmax(head.draft_logits(out), dim=-1)).sum(-1).mean()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def chain_mask(rows: int, starts: list[int], first: int) -> torch.Tensor:
    """What each of `rows` chains sees at a training-time test step: the target's positions 0..j (the first
    step's entries, `first` of them) and its own entries of the steps since (`starts`: where each step's entries
    begin in the cache, the first step's at 0), itself included. [rows, cache + rows] bool.

    Example (a chunk of 4 tokens: 3 first-step entries, 2 chains at step 2):
        >>> chain_mask(2, [0], 3).int().tolist()
        [[1, 0, 0, 1, 0], [1, 1, 0, 0, 1]]
    """
    columns = starts[-1] + rows + 1  # the cache so far: the last step's entries were one chain more than now
    visible = torch.zeros(rows, columns + rows, dtype=torch.bool)
    chain = torch.arange(rows)
    visible[:, :first] = torch.arange(first)[None] <= chain[:, None]
    for start in starts[1:]:
        visible[chain, start + chain] = True
    visible[chain, columns + chain] = True
    return visible


def train_head(model, tokenizer, texts: Iterable[str], out: Path | str, config: TrainConfig = TrainConfig(),
               report: Callable[[int, float, float], None] | None = None) -> Path:  # fmt: skip
    """Train a head for `model` on `texts` for `config.seconds` and write it to folder `out`; returns the folder.
    `report(step, loss, seconds)` after every step (a progress bar)."""
    torch.manual_seed(config.seed)
    frozen = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)  # the target (its embedding, which the head shares) is not trained
    try:
        return train_loop(model, tokenizer, texts, Path(out), config, report)
    finally:
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(frozen[name])


def train_loop(model, tokenizer, texts, out: Path, config: TrainConfig, report) -> Path:
    """`train_head` with the target frozen."""
    layers_count = model.config.num_hidden_layers
    layers = default_aux_layers(layers_count)
    stream = chunks_of(tokenizer, texts, config.chunk)
    first = [ids for ids, _ in zip(stream, range(config.vocab_chunks), strict=False)]
    used = draft_vocabulary(model, first, config.draft_vocab)
    head = new_head(model, used, layers)
    trained = [p for name, p in head.named_parameters() if not name.startswith("embed_tokens.")]
    optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=0.0)
    started, step = time.perf_counter(), 0
    for ids in itertools.chain(first, stream, itertools.cycle(chunks_of(tokenizer, texts, config.chunk))):
        features, logits = target_reading(model, ids, layers)
        loss = train_step(head, optimizer, ids, features, logits, used, config.unroll)
        step += 1
        elapsed = time.perf_counter() - started
        if report is not None:
            report(step, loss, elapsed)
        if elapsed > config.seconds:
            break
    return save_head(head, out, {"steps": step, "seconds": round(time.perf_counter() - started)})


def save_head(head: Eagle3Head, folder: Path, training: dict) -> Path:
    """config.json and model.safetensors (bf16 weights; the embedding is the target's, not written)."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = head.config.to_dict()
    raw["forerun_training"] = training
    (folder / "config.json").write_text(json.dumps(raw, indent=1) + "\n")
    state = {
        name: (tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor).contiguous()
        for name, tensor in head.state_dict().items()
        if not name.startswith("embed_tokens.")
    }
    save_file(state, str(folder / "model.safetensors"))
    return folder
