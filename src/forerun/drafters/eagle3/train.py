"""Train an EAGLE-3 head for a target on this machine: on the target's own hidden states and next-token
distributions, written in SpecForge's export layout (so SGLang and SpecForge can load it too).

The target reads every text once (`forerun.drafters.eagle3.readings`: its three auxiliary layers' outputs and its
most probable next tokens at every position, kept); training then goes over those readings, packed several texts
a step, as many times as its time allows. The head reads position i's features with the token after it and is
trained to put the target's own distribution at position i + 1 (over the draft vocabulary, renormalised) on what
comes after that: the cross-entropy between the two. The draft vocabulary is the `draft_vocab` tokens the target
itself predicts most often on the training text; the head's output matrix starts as the target's own rows for
them, its embedding is the target's (not written), the rest starts at random.

Deeper levels of the draft tree feed the head its own output in place of the target's features (it has none for
unverified tokens), so the head is also trained that way (EAGLE-3's training-time test, `TrainConfig.unroll`): step
s reads, at each position, the token s places ahead with the head's step s-1 output there, sees the target's
positions up to its chain's start and its own chain's entries, and is trained on the target's distribution s
places ahead. The steps' losses are summed with weights 0.8^(s-1), as SpecForge weighs them.

One text in twenty is held out: the head's top-1 agreement with the target there, per level, is written into
its config.json (`forerun_training.held_out_accuracy`): the acceptance a greedy tree can expect at each depth.

Example:
    >>> folder = train_head(model, tokenizer, texts, "heads/smollm2", TrainConfig(seconds=1800))   # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from forerun.base.packed import dense_matrix
from forerun.base.weights import vocabulary_rows
from forerun.drafters.eagle3.head import Eagle3Head, HeadCache, default_aux_layers, head_config
from forerun.drafters.eagle3.readings import Pack, Reading, draft_vocabulary, packs, read_texts


@dataclass(frozen=True)
class TrainConfig:
    draft_vocab: int = 8192
    """Tokens the head can propose (the target's most frequent predictions on the training text)."""
    pack: int = 1024
    """Tokens a training step reads: whole texts side by side (a longer text is cut into pieces this long)."""
    seconds: float = 1800.0
    """Wall-clock budget for training (the target's reading pass not counted)."""
    lr: float = 1e-3
    """Peak learning rate: reached after the first 3% of the time, then down a cosine to a tenth of it."""
    seed: int = 0
    unroll: int = 1
    """Training-time test steps (module docstring): 1 trains the first level only; each more step costs about as
    much again and trains one more level on the head's own outputs."""
    top: int = 4
    """The target's most probable next tokens kept per position as the label."""
    max_tokens: int = 1_000_000
    """Tokens read at most (their features are kept in memory: 3 * hidden bf16 values a token)."""
    bf16: bool = False
    """The head's matmuls in bf16 (autocast; its weights and optimizer stay fp32): about twice as fast on a CPU
    with bf16 instructions."""


def stdlib_texts() -> list[str]:
    """The Python standard library's top-level source files, in name order: text on this machine that none of
    the benchmark's datasets or prompts contain (code and its docstrings)."""
    import sysconfig

    folder = Path(sysconfig.get_paths()["stdlib"])
    return [path.read_text(encoding="utf-8", errors="replace") for path in sorted(folder.glob("*.py"))]


def new_head(model, used: torch.Tensor, layers: tuple[int, ...]) -> Eagle3Head:
    """A head shaped like one of the target's layers, over draft vocabulary `used` (target ids, sorted)."""
    config = model.config
    vocab = vocabulary_rows(model)
    head_conf = head_config(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, vocab,
                            len(used), config.hidden_size)  # fmt: skip
    head_conf.intermediate_size = config.intermediate_size
    head_conf.rope_theta = getattr(config, "rope_theta", 10000.0)
    head_conf.rms_norm_eps = config.rms_norm_eps
    head_conf.max_position_embeddings = config.max_position_embeddings
    head_conf.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(layers)}
    head = Eagle3Head(head_conf, model.get_input_embeddings(), layers)  # fp32; the embedding is the target's own
    with torch.no_grad():
        head.lm_head.weight.copy_(dense_matrix(model.get_output_embeddings())[used].float())
        head.d2t.copy_(used - torch.arange(len(used)))
        head.t2d.zero_()
        head.t2d[used] = True
    return head


def unrolled(
    head: Eagle3Head,
    ids: torch.Tensor,
    features: torch.Tensor,
    unroll: int,
    positions: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The head's outputs at each training-time test step on `ids` [1, T] with the target's `features` [T, 3H]:
    step s gives [T - s, H], row j the chain that starts at position j (module docstring). `positions` and
    `segments` [T] when several texts lie side by side (`Pack`): a chain sees only its own text."""
    length, cache = ids.shape[1], HeadCache()
    positions = torch.arange(length) if positions is None else positions
    segments = torch.zeros(length, dtype=torch.long) if segments is None else segments
    hidden, outputs, starts = head.project(features[:-1].float()), [], []
    for step in range(1, min(unroll, length - 1) + 1):
        rows = length - step  # chains that reach this far
        same_text = segments[:rows, None] == segments[None, : length - 1]
        if step == 1:
            visible = same_text & (torch.arange(length - 1)[None] <= torch.arange(rows)[:, None])
        else:
            visible = chain_mask(rows, starts, length - 1)
            visible[:, : length - 1] &= same_text
        starts.append(cache.length)
        hidden = head(ids[0, step:], hidden[:rows], positions[:rows] + step - 1, cache, visible)
        outputs.append(hidden)
    return outputs


def draft_index(used: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab]: each target token's row in the draft vocabulary `used` (sorted target ids), -1 where it has none.

    Example:
        >>> draft_index(torch.tensor([2, 5]), 6).tolist()
        [-1, -1, 0, -1, -1, 1]
    """
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[used] = torch.arange(len(used))
    return index


def pack_loss(head: Eagle3Head, pack: Pack, index: torch.Tensor, unroll: int) -> tuple[torch.Tensor, list[float]]:
    """The weighted cross-entropy over `pack`'s training-time test steps (module docstring), and, without
    gradients (held-out text), the head's top-1 agreement with the target's first choice at each step (chains
    within one text only; an empty list while training)."""
    loss, agreement = torch.zeros(()), []
    outputs = unrolled(head, pack.ids[None], pack.features, unroll, pack.positions, pack.segments)
    for step, out in enumerate(outputs, start=1):
        rows = out.shape[0]
        labels = index[pack.top_ids[step:]]  # [rows, top] draft rows of the target's choices s places ahead
        odds = pack.top_probs[step:].float() * (labels >= 0)
        keep = (pack.segments[step:] == pack.segments[:rows]) & (odds.sum(-1) > 0)
        if not bool(keep.any()):
            break
        odds = odds[keep] / odds[keep].sum(-1, keepdim=True)
        logits = head.draft_logits(out[keep])
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[keep].clamp_min(0))
        loss = loss + 0.8 ** (step - 1) * -(odds * logp).sum(-1).mean()
        if not torch.is_grad_enabled():  # measured on held-out text only: a training step need not pay for it
            chosen = head.target_ids(logits.argmax(-1))
            agreement.append(float((chosen == pack.top_ids[step:][keep][:, 0]).float().mean()))
    return loss, agreement


def train_step(head: Eagle3Head, optimizer, pack: Pack, index: torch.Tensor, unroll: int = 1) -> float:
    """One optimizer step on one pack; returns its loss."""
    loss, _ = pack_loss(head, pack, index, unroll)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def held_out_agreement(head: Eagle3Head, held: list[Pack], index: torch.Tensor, unroll: int) -> list[float]:
    """The head's top-1 agreement with the target per training-time test step, averaged over `held` packs."""
    per_pack = [pack_loss(head, pack, index, unroll)[1] for pack in held]
    steps = min((len(a) for a in per_pack), default=0)
    return [round(sum(a[s] for a in per_pack) / len(per_pack), 4) for s in range(steps)]


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
               report: Callable[[int, float, float], None] | None = None,
               read: Callable[[int], None] | None = None, start: Eagle3Head | None = None) -> Path:  # fmt: skip
    """Train a head for `model` on `texts` for `config.seconds` and write it to folder `out`; returns the folder.
    `read(tokens)` after each text the target reads, `report(step, loss, seconds)` after every training step
    (progress bars). `start`: a head to train further (its layers, draft vocabulary and weights; e.g. the shipped
    one, `load_head("smollm2-135m", model, dtype=torch.float32)`) instead of a new one."""
    torch.manual_seed(config.seed)
    frozen = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)  # the target (its embedding, which the head shares) is not trained
    try:
        layers = start.aux_layers if start is not None else default_aux_layers(model.config.num_hidden_layers)
        readings = read_corpus(model, tokenizer, texts, layers, config, read)
        return train_loop(model, readings, layers, Path(out), config, report, start)
    finally:
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(frozen[name])


def read_corpus(model, tokenizer, texts, layers, config: TrainConfig, read) -> list[Reading]:
    """The target's readings of `texts`, up to `config.max_tokens` tokens."""
    readings, tokens = [], 0
    for reading in read_texts(model, tokenizer, texts, layers, config.top, config.pack):
        readings.append(reading)
        tokens += len(reading)
        if read is not None:
            read(tokens)
        if tokens >= config.max_tokens:
            break
    if not readings:
        raise ValueError("train-head: the corpus has no text to train on (every text shorter than 3 tokens)")
    return readings


def train_loop(model, readings: list[Reading], layers, out: Path, config: TrainConfig, report,
               start: Eagle3Head | None = None) -> Path:  # fmt: skip
    """Train on all readings but every 20th (held out, when there are 20 or more) for `config.seconds`; save."""
    held = readings[::20] if len(readings) >= 20 else []
    trained_on = [r for i, r in enumerate(readings) if not held or i % 20]
    vocab = vocabulary_rows(model)
    if start is None:
        used = draft_vocabulary(trained_on, vocab, config.draft_vocab)
        head = new_head(model, used, layers)
    else:  # its draft vocabulary stays: its output matrix's rows mean those tokens
        head = start.train()
        for module in head.children():  # its embedding (the target's, or its own) is not trained
            if module is not head.embed_tokens:
                module.float().requires_grad_(True)
        used = head.target_ids(torch.arange(head.lm_head.weight.shape[0], device=head.d2t.device))
    index = draft_index(used, vocab)
    trained = [p for name, p in head.named_parameters() if not name.startswith("embed_tokens.")]
    optimizer = torch.optim.AdamW(trained, lr=config.lr, weight_decay=0.0)
    batches, order = packs(trained_on, config.pack), torch.Generator().manual_seed(config.seed)
    started, step, elapsed, passes = time.perf_counter(), 0, 0.0, 0
    while elapsed <= config.seconds:
        passes += 1
        for number in torch.randperm(len(batches), generator=order).tolist():
            for group in optimizer.param_groups:
                group["lr"] = config.lr * learning_rate_scale(elapsed / config.seconds)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
                loss = train_step(head, optimizer, batches[number], index, config.unroll)
            step, elapsed = step + 1, time.perf_counter() - started
            if report is not None:
                report(step, loss, elapsed)
            if elapsed > config.seconds:
                break
    agreement = held_out_agreement(head, packs(held, config.pack), index, config.unroll)
    training = {"steps": step, "seconds": round(elapsed), "passes": passes, "tokens": sum(map(len, trained_on)),
                "held_out_tokens": sum(map(len, held)), "held_out_accuracy": agreement}  # fmt: skip
    if start is not None:  # the training it had before (nested as deep as it goes)
        training["started_from"] = getattr(start.config, "forerun_training", None)
    shared = head.embed_tokens is model.get_input_embeddings()
    return save_head(head, out, training, own_embedding=not shared)


def learning_rate_scale(progress: float) -> float:
    """The learning rate's share of its peak at `progress` (0..1 of the time): a warm-up over the first 3%, then
    a cosine down to a tenth.

    Example:
        >>> [round(learning_rate_scale(p), 2) for p in (0.0, 0.03, 0.5, 1.0)]
        [0.0, 1.0, 0.57, 0.1]
    """
    if progress < 0.03:
        return progress / 0.03
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (progress - 0.03) / 0.97)))


def save_head(head: Eagle3Head, folder: Path, training: dict, own_embedding: bool = False) -> Path:
    """config.json and model.safetensors (bf16 weights; the embedding only where it is the head's own)."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = head.config.to_dict()
    raw["forerun_training"] = training
    (folder / "config.json").write_text(json.dumps(raw, indent=1) + "\n")
    state = {
        name: (tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor).contiguous()
        for name, tensor in head.state_dict().items()
        if own_embedding or not name.startswith("embed_tokens.")
    }
    save_file(state, str(folder / "model.safetensors"))
    return folder
