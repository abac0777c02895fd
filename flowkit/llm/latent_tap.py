"""Capture hidden states at layer percentiles with forward hooks, inside a forward that runs anyway."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from flowkit.errors import ConfigError
from flowkit.llm.backbone import decoder_layers


def tapped_layer_indices(percentiles: Sequence[float], num_layers: int) -> list[int]:
    """Hidden-state indices ``h = round(p·L) + 1`` for layer percentiles ``p``, as the official RLFR code taps.

    The official code hooks decoder block ``model.layers[round(p·L)]`` (0-based); its output is HF's
    ``output_hidden_states`` entry ``h`` = block index + 1 (for L = 28: 8 / 15 / 22 at P = 0.25 / 0.5 / 0.75).
    The tap records the block's own output, so at h = L it is the last block's output before the final norm (HF's
    last hidden state is after it). A percentile with round(p·L) = L names a block that does not exist: the official
    code clamps it to the last block (L−1) silently, which another percentile may tap already; flowkit refuses it
    (:class:`~flowkit.errors.ConfigError`) and names the percentile of the last block, (L−1)/L.
    """
    indices = []
    for p in percentiles:
        if not 0.0 < p <= 1.0:
            raise ValueError(f"layer percentile must be in (0, 1], got {p}")
        block = round(p * num_layers)
        if block >= num_layers:
            raise ConfigError(f"percentiles: {p} taps decoder block round({p}·{num_layers}) = {block}, but the "
                              f"model's blocks are 0..{num_layers - 1}; the last block is percentile "
                              f"{(num_layers - 1) / num_layers:.4g}")
        indices.append(block + 1)
    return indices


class _TappedBlocksDone(Exception):
    """Raised by the deepest tapped block's hook to end a forward whose only product is the latents."""


class LatentTap:
    """Context manager that records the outputs of the tapped decoder blocks during a forward.

    >>> with LatentTap(model, [0.25, 0.5, 0.75]) as tap:
    ...     logits = model(input_ids).logits
    >>> tap.latents  # P×B×S×d, detached
    """

    def __init__(self, model: torch.nn.Module, percentiles: Sequence[float]):
        layers = decoder_layers(model)
        self.num_layers = len(layers)
        self.indices = tapped_layer_indices(percentiles, self.num_layers)
        self._modules = [layers[h - 1] for h in self.indices]
        self._captured: list[Tensor | None] = [None] * len(self.indices)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def layer_positions(self) -> list[float]:
        """The layer-position value fed to the velocity field for each tap: block index / L = (h − 1) / L (official)."""
        return [(h - 1) / self.num_layers for h in self.indices]

    def __enter__(self) -> LatentTap:
        self._captured = [None] * len(self.indices)
        for slot, module in enumerate(self._modules):
            self._handles.append(module.register_forward_hook(self._hook(slot)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, slot: int):
        def record(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._captured[slot] = hidden.detach()

        return record

    @torch.no_grad()
    def capture(self, run_forward: Callable[[], object], stop_early: bool = True) -> Tensor:
        """The latents of ``run_forward()``, without gradients. With ``stop_early`` the forward ends right after the
        deepest tapped block: later blocks and the LM head never run (at P = 0.25/0.5/0.75 a quarter of the blocks
        and the vocabulary projection). Pass False where every module must run, e.g. under DeepSpeed ZeRO-3, whose
        parameter prefetching follows the order of complete forwards."""
        with self:
            handle = None
            if stop_early:
                # registered after the recording hooks of __enter__, so the deepest block records before it stops
                handle = self._modules[self.indices.index(max(self.indices))].register_forward_hook(self._stop)
            try:
                run_forward()
            except _TappedBlocksDone:
                pass
            finally:
                if handle is not None:
                    handle.remove()
            return self.latents

    @staticmethod
    def _stop(_module, _inputs, _output):
        raise _TappedBlocksDone

    @property
    def latents(self) -> Tensor:
        if any(t is None for t in self._captured):
            raise RuntimeError("LatentTap.latents read before a forward pass ran inside the tap")
        return torch.stack(self._captured)  # type: ignore[arg-type]
