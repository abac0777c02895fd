import torch

from flowkit.batch import RolloutBatch


def make(rows: int, length: int, with_latents: bool = True) -> RolloutBatch:
    return RolloutBatch(
        input_ids=torch.arange(rows * length).view(rows, length),
        attention_mask=torch.ones(rows, length, dtype=torch.long),
        response_mask=torch.ones(rows, length),
        group_ids=torch.arange(rows),
        prompts=[f"p{i}" for i in range(rows)],
        latents=torch.randn(3, rows, length, 4) if with_latents else None,
    )


def test_select_rows_of_every_field():
    batch = make(4, 5)
    picked = batch.select(torch.tensor([True, False, True, False]))
    assert picked.prompts == ["p0", "p2"]
    assert torch.equal(picked.input_ids, batch.input_ids[[0, 2]])
    assert torch.equal(picked.latents, batch.latents[:, [0, 2]])


def test_cat_pads_to_longest():
    merged = RolloutBatch.cat([make(2, 3), make(1, 5)])
    assert merged.input_ids.shape == (3, 5)
    assert merged.latents.shape == (3, 3, 5, 4)
    assert merged.attention_mask[:2, 3:].sum() == 0
    assert merged.prompts == ["p0", "p1", "p0"]
