import numpy as np
import pytest

from flowkit.rbrl.binpacking import BinPackingEnv, BinPackingLanguage


def _env_with(counts: dict[int, int], item: int) -> BinPackingEnv:
    env = BinPackingEnv()
    env.reset(seed=0)
    env.counts[:] = 0
    for level, n in counts.items():
        env.counts[level] = n
    env.item = item
    return env


def test_fill_bag_exactly_closes_it_and_earns_item_size():
    env = _env_with({7: 1, 4: 1}, item=2)
    assert env.waste == 2 + 5
    obs, reward, terminated, truncated, info = env.step(7)
    assert reward == 2.0 and not info["invalid"]
    assert env.counts[7] == 0 and env.counts[4] == 1 and env.counts[9 - 1] == 0
    assert env.waste == 5 and not terminated and not truncated
    assert obs.shape == (10,) and obs[3] == 1  # level-4 bag still open (index level-1)


def test_partial_fill_moves_bag_up_a_level():
    env = _env_with({4: 2}, item=3)
    _, reward, _, _, info = env.step(4)
    assert reward == 3.0 and not info["invalid"]
    assert env.counts[4] == 1 and env.counts[7] == 1


def test_new_bag_costs_its_free_space():
    env = _env_with({}, item=3)
    _, reward, _, _, _ = env.step(0)
    assert reward == -6.0 and env.counts[3] == 1 and env.waste == 6


@pytest.mark.parametrize("counts,item,action", [({7: 1}, 3, 7), ({}, 2, 4), ({5: 1}, 2, 6)])
def test_invalid_placement_is_penalised_and_changes_nothing(counts, item, action):
    env = _env_with(counts, item)
    before = env.counts.copy()
    _, reward, _, _, info = env.step(action)
    assert info["invalid"] and reward == -env.invalid_penalty
    np.testing.assert_array_equal(env.counts, before)


def test_out_of_range_action_raises():
    env = _env_with({}, item=2)
    with pytest.raises(ValueError):
        env.step(9)


def test_episode_return_is_minus_final_waste_and_horizon_is_32():
    env = BinPackingLanguage()
    env.reset(seed=3)
    rng = np.random.default_rng(0)
    total, steps, done = 0.0, 0, False
    while not done:
        action = int(rng.choice(list(env.valid_actions())))
        _, reward, done, _, _ = env.step(action)
        total += reward
        steps += 1
    assert steps == 32
    assert total == -env.unwrapped.waste


def test_item_distribution_matches_official_settings():
    env = BinPackingEnv()
    env.reset(seed=1)
    draws = np.array([env._draw_item() for _ in range(4000)])
    for size, prob in zip((2, 3, 6), (0.7, 0.2, 0.1)):
        assert abs((draws == size).mean() - prob) < 0.03
    assert env.capacity == 9 and env.horizon == 32


def test_language_wrapper_lists_only_valid_actions():
    env = BinPackingLanguage()
    env.reset(seed=0)
    env.unwrapped.counts[:] = 0
    env.unwrapped.counts[3] = 1
    env.unwrapped.counts[8] = 1
    env.unwrapped.item = 3
    assert set(env.valid_actions()) == {0, 3}
    text = env.describe()
    assert "size 3" in text and "1 bag(s) at level 3" in text and "1 bag(s) at level 8" in text
    assert "capacity 9" in env.task and "Valid actions" in env.prompt()
