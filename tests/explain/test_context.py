import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flowkit.explain.context import ContextEncoding, encode_context, last_layer
from flowkit.explain.flow_net import ExplanationFlow
from flowkit.explain.sentence_rewards import flow_sentence_rewards, prefix_table


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of storages that tensors created inside the mode keep alive, and their peak.

    A storage is counted once (views share it) and released when the last tensor seen on it is freed.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key not in self._refs:
            self._refs[key] = 0
            self.live += size
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        weakref.finalize(tensor, self._release, key, size)

    def _release(self, key: int, size: int) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= size


def _rows(batch: int, length: int = 48, vocab: int = 50):
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=generator)
    lengths[0] = length
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    return ids * mask, mask


def _reference_encoding(backbone, ids, mask) -> ContextEncoding:
    """The former path: one CausalLM forward with the whole KV cache, every layer's hidden states and logits."""
    out = backbone(input_ids=ids, attention_mask=mask, use_cache=True, output_hidden_states=True)
    cache = out.past_key_values.layers[-1]
    return ContextEncoding(cache.keys, cache.values, out.hidden_states[-1], mask.sum(-1), last_layer(backbone))


def test_micro_batched_last_layer_encoding_equals_the_full_cached_forward(backbone):
    ids, mask = _rows(5)
    reference = _reference_encoding(backbone, ids, mask)
    encoded = encode_context(backbone, ids, mask, micro_batch_size=2)
    real = mask.bool()
    torch.testing.assert_close(encoded.keys.transpose(1, 2)[real], reference.keys.transpose(1, 2)[real])
    torch.testing.assert_close(encoded.values.transpose(1, 2)[real], reference.values.transpose(1, 2)[real])
    torch.testing.assert_close(encoded.hidden[real], reference.hidden[real])
    assert encode_context(backbone, ids, mask, keep_hidden=False).hidden is None


def test_sentence_rewards_are_unchanged_by_the_memory_bounded_encoding(backbone):
    ids, mask = _rows(4)
    lengths = mask.sum(-1)
    prompt = torch.full((4,), 10)
    ends = [[int(e) for e in torch.linspace(5, int(n) - 10, 3).long()] for n in lengths]
    prefixes, prefix_mask = prefix_table(prompt, ends)
    decisions = torch.tensor([0, 1, 2, 3])
    for use_attention in (True, False):
        torch.manual_seed(0)
        flow = ExplanationFlow(4, backbone.config.hidden_size, time_dim=16, projector_dim=32,
                               use_attention=use_attention)
        rewards = [flow_sentence_rewards(flow, context, prefixes, prefix_mask, decisions, num_draws=4, num_steps=3,
                                         generator=torch.Generator().manual_seed(1)).rewards
                   for context in (_reference_encoding(backbone, ids, mask),
                                   encode_context(backbone, ids, mask, micro_batch_size=3,
                                                  keep_hidden=not use_attention))]
        torch.testing.assert_close(rewards[1], rewards[0], atol=1e-6, rtol=1e-5)
        assert rewards[0].abs().sum() > 0


def _peak_beyond_result(encode, ids, mask) -> tuple[int, int]:
    """(peak live tensor bytes during ``encode`` beyond what its result keeps, bytes the result keeps)."""
    with LiveTensorBytes() as counter:
        result = encode(ids, mask)
        kept = counter.live
    del result
    return counter.peak - kept, kept


def test_a_rounds_encoding_peak_stays_flat_from_one_to_eight_times_the_explanations(backbone):
    """Beyond the last-layer K/V it returns, the encoding's peak is one micro-batch's activations; the former
    full forward (logits, all layers' K/V and hidden states) grows with the explanations — the counter sees it."""
    bounded = lambda ids, mask: encode_context(backbone, ids, mask, micro_batch_size=4, keep_hidden=False)
    full = lambda ids, mask: _reference_encoding(backbone, ids, mask)
    small, large = _rows(4), _rows(32)
    peak_small, kept_small = _peak_beyond_result(bounded, *small)
    peak_large, kept_large = _peak_beyond_result(bounded, *large)
    assert peak_large <= 1.3 * peak_small, (peak_small, peak_large)
    assert kept_large == 8 * kept_small  # the kept K/V are the last layer's, linear in the explanations
    full_small, _ = _peak_beyond_result(full, *small)
    full_large, _ = _peak_beyond_result(full, *large)
    assert full_large > 4 * full_small, (full_small, full_large)
