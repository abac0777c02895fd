import numpy as np
import pytest

from flowkit.rbrl.binpacking import BinPackingEnv, BinPackingLanguage


def _env_with(counts: dict[int, int], item: int, **kwargs) -> BinPackingEnv:
    env = BinPackingEnv(**({"reward_scale": 1.0} | kwargs))  # unscaled, so rewards read as waste units
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
def test_penalty_variant_penalises_invalid_placement_and_changes_nothing(counts, item, action):
    env = _env_with(counts, item, invalid_action="penalty")
    before = env.counts.copy()
    _, reward, terminated, _, info = env.step(action)
    assert info["invalid"] and reward == -env.invalid_penalty and not terminated
    np.testing.assert_array_equal(env.counts, before)


def test_official_invalid_placement_ends_the_episode_with_minus_100_minus_last_waste_change():
    # a new bag for a 3 (waste +6), then a 2 into a level-7 bag that does not exist: −100 − 6
    env = _env_with({}, item=3)
    _, reward, terminated, _, _ = env.step(0)
    assert reward == -6.0 and not terminated
    env.item = 2
    _, reward, terminated, _, info = env.step(7)
    assert info["invalid"] and terminated and reward == -106.0 and env.counts[3] == 1
    # after a fill (waste change −size = −3) an overflow ends it with −100 + 3
    env = _env_with({4: 1, 7: 1}, item=3)
    assert env.step(4)[1] == 3.0
    env.item = 3
    _, reward, terminated, _, _ = env.step(7)  # 7 + 3 > 9
    assert terminated and reward == -97.0
    # before any placement the change is 0
    env = _env_with({}, item=2)
    assert env.step(5)[1:3] == (-100.0, True)


def test_official_reward_scale_is_one_hundredth():
    unscaled, scaled = _env_with({}, item=3), _env_with({}, item=3, reward_scale=0.01)
    assert BinPackingEnv().reward_scale == 0.01 and BinPackingEnv().invalid_action == "end"
    assert unscaled.step(0)[1] == -6.0 and scaled.step(0)[1] == pytest.approx(-0.06)


def test_out_of_range_action_raises():
    env = _env_with({}, item=2)
    with pytest.raises(ValueError):
        env.step(9)


def test_episode_return_is_minus_final_waste_and_horizon_is_32():
    env = BinPackingLanguage(reward_scale=1.0)
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
