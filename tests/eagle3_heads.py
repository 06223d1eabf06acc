"""Random EAGLE-3 heads for the tiny test models (`tiny_models`), in memory or written in SpecForge's layout."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from forerun.drafters.eagle3 import Eagle3Head, head_config

from tiny_models import VOCAB

DRAFT_VOCAB = 40


def random_head(
    target: torch.nn.Module, seed: int = 0, draft_vocab: int = DRAFT_VOCAB, aux: tuple[int, ...] | None = None
) -> Eagle3Head:
    """A seeded random head over `target` (its embedding shared), drafting every other target token; `aux`: the
    target layers it reads (default: the first, second and last)."""
    config = head_config(64, heads=4, kv_heads=2, vocab=VOCAB, draft_vocab=draft_vocab,
                         target_hidden=target.config.hidden_size)  # fmt: skip
    torch.manual_seed(seed)
    layers = target.config.num_hidden_layers
    aux = (min(1, layers - 1), 0, layers - 1) if aux is None else aux
    head = Eagle3Head(config, target.get_input_embeddings(), aux)
    step = VOCAB // draft_vocab
    head.d2t.copy_(torch.arange(0, step * draft_vocab, step) - torch.arange(draft_vocab))
    return head.to(target.dtype).eval()


def write_head(folder, target, *, hidden=64, fc_norm=False, norm_output=True, own_embedding=False, aux=None,
               edit_config=None, edit_state=None, heads=(4, 2), vocab=VOCAB,
               draft_vocab=DRAFT_VOCAB) -> dict:  # fmt: skip
    """A random head for `target` in SpecForge's export layout (config.json and model.safetensors); returns the
    state written. `edit_config` / `edit_state` change the dict / tensors before writing (malformed heads)."""
    config = head_config(hidden, heads=heads[0], kv_heads=heads[1], vocab=vocab, draft_vocab=draft_vocab,
                         target_hidden=target.config.hidden_size)  # fmt: skip
    config.fc_norm, config.norm_output = fc_norm, norm_output
    torch.manual_seed(0)
    head = Eagle3Head(config, torch.nn.Embedding(vocab, hidden))
    used = torch.arange(0, 2 * draft_vocab, 2)  # every other target token is in the draft vocabulary
    state = {k: v.contiguous() for k, v in head.state_dict().items()}
    state["d2t"], state["t2d"] = used - torch.arange(draft_vocab), torch.zeros(vocab, dtype=torch.bool)
    state["t2d"][used] = True
    if not own_embedding:
        del state["embed_tokens.weight"]
    raw = config.to_dict()
    if aux is not None:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    (edit_config or (lambda r: None))(raw)
    (edit_state or (lambda s: None))(state)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(state, str(folder / "model.safetensors"))
    return state
