import pytest
import torch

from flowkit.errors import ConfigError
from flowkit.llm.latent_tap import LatentTap, tapped_layer_indices
from flowkit.llm.tiny import char_tokenizer, tiny_qwen2


def test_layer_indices_by_hand():
    # The official code hooks block round(p·L) (0-based): HF hidden-state index round(p·L) + 1.
    assert tapped_layer_indices([0.25, 0.5, 0.75], 28) == [8, 15, 22]
    assert tapped_layer_indices([0.25, 0.5, 0.75], 4) == [2, 3, 4]
    assert tapped_layer_indices([0.01], 4) == [1]  # block 0
    with pytest.raises(ValueError):
        tapped_layer_indices([0.0], 4)


@pytest.mark.parametrize(("percentile", "layers", "last"), [(1.0, 4, "0.75"), (0.99, 28, "0.9643")])
def test_a_percentile_past_the_last_block_is_refused_not_clamped(percentile, layers, last):
    """The official code clamps block round(p·L) = L to the last block, silently tapping it twice next to p = (L−1)/L."""
    with pytest.raises(ConfigError, match=rf"percentiles: {percentile} taps decoder block round\({percentile}·{layers}\) = "
                                          rf"{layers}, but the model's blocks are 0..{layers - 1}; the last block is "
                                          rf"percentile {last}$"):
        tapped_layer_indices([0.25, percentile], layers)


def test_layer_positions_are_block_index_over_depth():
    """The flow sees the official layer value: the hooked block's 0-based index / L (7/28 = 0.25 for L = 28)."""
    model = tiny_qwen2(len(char_tokenizer("0123456789+=")), hidden_size=64, num_layers=28)
    tap = LatentTap(model, [0.25, 0.5, 0.75, 27 / 28])
    assert tap.indices == [8, 15, 22, 28]
    assert tap.layer_positions == [7 / 28, 14 / 28, 21 / 28, 27 / 28]


def test_tap_equals_hf_hidden_states_and_is_detached():
    tokenizer = char_tokenizer("0123456789+=")
    model = tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=4)
    ids = torch.randint(4, len(tokenizer), (2, 9))
    tap = LatentTap(model, [0.25, 0.5, 0.75])
    with tap:
        out = model(ids, output_hidden_states=True)
    assert tap.indices == [2, 3, 4]
    assert tap.layer_positions == [0.25, 0.5, 0.75]
    for slot, h in enumerate(tap.indices[:2]):
        assert torch.equal(tap.latents[slot], out.hidden_states[h])
    # h = L is the last block's own output; HF's last hidden state is that after the final norm
    assert not torch.equal(tap.latents[2], out.hidden_states[4])
    torch.testing.assert_close(model.model.norm(tap.latents[2]), out.hidden_states[4])
    assert not tap.latents.requires_grad
    # hooks are removed on exit: another forward does not overwrite the captured latents
    before = tap.latents.clone()
    model(ids.flip(-1))
    assert torch.equal(tap.latents, before)


@pytest.mark.parametrize("percentiles", [[0.25], [0.5, 0.25]])
@pytest.mark.parametrize("stop_early", [True, False])
def test_capture_stops_after_the_deepest_tapped_block(percentiles, stop_early):
    tokenizer = char_tokenizer("0123456789+=")
    model = tiny_qwen2(len(tokenizer), hidden_size=64, num_layers=4)
    ids = torch.randint(4, len(tokenizer), (2, 9))
    tap = LatentTap(model, percentiles)
    with tap:
        model(ids)
    full = tap.latents
    ran = []
    hooks = [module.register_forward_hook(lambda m, i, o, name=name: ran.append(name))
             for name, module in [("block 3", model.model.layers[3]), ("lm head", model.lm_head)]]
    latents = tap.capture(lambda: model(ids), stop_early=stop_early)
    for hook in hooks:
        hook.remove()
    assert torch.equal(latents, full) and not latents.requires_grad
    assert ran == ([] if stop_early else ["block 3", "lm head"])
    assert model(ids).logits.shape[:2] == ids.shape  # capture left no stop hook behind (it would raise here)
