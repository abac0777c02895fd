import pytest
import torch

from flowkit.rbrl.replay import FIELDS, ReplayBuffer, pad_rules


def _transition(i: float, n_rules: int = 2):
    rules, mask = pad_rules(torch.full((n_rules, 3), i), 4)
    return {"state": torch.tensor([i]), "rules": rules, "mask": mask, "action": torch.tensor(1),
            "env_reward": torch.tensor(i), "rule_reward": torch.tensor(0.5), "done": torch.tensor(0.0),
            "next_state": torch.tensor([i + 1]), "next_rules": rules, "next_mask": mask}


def test_pad_rules():
    padded, mask = pad_rules(torch.ones(2, 3), 4)
    assert padded.shape == (4, 3) and mask.tolist() == [True, True, False, False] and padded[2:].abs().sum() == 0
    with pytest.raises(ValueError):
        pad_rules(torch.ones(5, 3), 4)


def test_ring_buffer_overwrites_oldest_and_samples_stored_rows():
    buffer = ReplayBuffer(capacity=3)
    with pytest.raises(RuntimeError):
        buffer.sample(2)
    for i in range(5):
        buffer.add(_transition(float(i)))
    assert len(buffer) == 3
    batch = buffer.sample(64, torch.Generator().manual_seed(0))
    assert set(batch) == set(FIELDS) and batch["rules"].shape == (64, 4, 3)
    assert set(batch["env_reward"].tolist()) == {2.0, 3.0, 4.0}
    torch.testing.assert_close(batch["next_state"][:, 0], batch["env_reward"] + 1)
