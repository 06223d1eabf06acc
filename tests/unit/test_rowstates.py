"""A batch's recurrent states, one row each: appended, written into a vacant row, dropped, and sliced out as a row's
own cache (`forerun.rowstates`), on the layers transformers gives a hybrid."""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

from forerun.rowcache import RowCache
from forerun.rowstates import append_states, keep_state_rows, row_cache, write_states

from tiny_models import prompts, tiny_model


def layer_of(conv: float, recurrent: float, rows: int = 1) -> LinearAttentionLayer:
    layer = LinearAttentionLayer()
    layer.update_conv_state(torch.full((rows, 3, 4), conv))
    layer.update_recurrent_state(torch.full((rows, 2, 2, 2), recurrent))
    return layer


def test_rows_are_appended_written_and_dropped():
    batch = LinearAttentionLayer()
    for value in (1.0, 2.0, 3.0):
        append_states(batch, layer_of(value, -value))
    assert batch.conv_states[0].shape == (3, 3, 4) and batch.has_previous_state[0]
    assert batch.conv_states[0][:, 0, -1].tolist() == [1.0, 2.0, 3.0]
    write_states(batch, layer_of(9.0, -9.0), place=1)
    assert batch.recurrent_states[0][:, 0, 0, 0].tolist() == [-1.0, -9.0, -3.0]
    keep_state_rows(batch, torch.tensor([0, 2]))
    assert batch.conv_states[0][:, 0, -1].tolist() == [1.0, 3.0]


def test_a_rows_own_cache_is_a_copy_of_its_row():
    """`RowCache.row` of a hybrid's batch: its visible keys and its states' row, of the same layer kinds; the
    batch's next writes do not reach it."""
    model = tiny_model("qwen3_5_text")
    rows = RowCache(model.config)
    for length in (6, 9):
        own = type(rows.cache)(config=model.config)
        with torch.inference_mode():
            model(input_ids=prompts(1, length)[0], cache=own, use_cache=True)
        rows.add(own, length)
    single = rows.row(0)
    kinds = [type(layer).__name__ for layer in single.layers]
    assert kinds == [type(layer).__name__ for layer in rows.cache.layers]
    attention = next(i for i, layer in enumerate(single.layers) if getattr(layer, "keys", None) is not None)
    assert single.layers[attention].keys.shape[2] == 6  # its own slots, not the padded 9
    states = next(i for i, layer in enumerate(single.layers) if isinstance(layer, LinearAttentionLayer))
    before = single.layers[states].recurrent_states[0].clone()
    rows.cache.layers[states].recurrent_states[0].add_(1.0)
    assert torch.equal(single.layers[states].recurrent_states[0], before)
    assert single.layers[states].recurrent_states[0].shape[0] == 1
    assert row_cache(rows.cache, 1, rows.visible[1].nonzero().flatten()).layers[attention].keys.shape[2] == 9
