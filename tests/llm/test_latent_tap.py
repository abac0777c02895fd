import pytest
import torch

from flowkit.llm.latent_tap import LatentTap, tapped_layer_indices
from flowkit.llm.tiny import char_tokenizer, tiny_qwen2


def test_layer_indices_by_hand():
    # round(p·L), clamped to L−1 (the last block is excluded) and at least 1
    assert tapped_layer_indices([0.25, 0.5, 0.75], 28) == [7, 14, 21]
    assert tapped_layer_indices([0.25, 0.5, 0.75], 4) == [1, 2, 3]
    assert tapped_layer_indices([1.0], 4) == [3]
    assert tapped_layer_indices([0.01], 4) == [1]
    with pytest.raises(ValueError):
        tapped_layer_indices([0.0], 4)


def test_tap_equals_hf_hidden_states_and_is_detached():
    tokenizer = char_tokenizer("0123456789+=")
    model = tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=4)
    ids = torch.randint(4, len(tokenizer), (2, 9))
    tap = LatentTap(model, [0.25, 0.5, 0.75])
    with tap:
        out = model(ids, output_hidden_states=True)
    assert tap.layer_positions == [0.25, 0.5, 0.75]
    for slot, h in enumerate(tap.indices):
        assert torch.equal(tap.latents[slot], out.hidden_states[h])
    assert not tap.latents.requires_grad
    # hooks are removed on exit: another forward does not overwrite the captured latents
    before = tap.latents.clone()
    model(ids.flip(-1))
    assert torch.equal(tap.latents, before)
