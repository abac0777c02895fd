import random

from flowkit.explain.gridworld import DECISIONS, HISTORY, MOVES, make_records, rollout, scripted_action
from flowkit.explain.sentences import split_sentences


def test_scripted_policy_moves_along_the_larger_gap_ties_to_x():
    assert scripted_action(3, 1) == "east" and scripted_action(-2, 2) == "west"
    assert scripted_action(1, -3) == "south" and scripted_action(0, 2) == "north"


def test_rollouts_reach_the_goal_and_records_hide_the_last_action():
    steps = rollout(random.Random(0), 6)
    x = y = 0
    for s in steps:
        x, y = x + MOVES[s.action][0], y + MOVES[s.action][1]
    assert (x, y) == (steps[0].dx, steps[0].dy)  # the moves add up to the first offset: the goal is reached
    for rec in make_records(200, seed=3):
        assert rec["context"].endswith("a=?") and rec["context"].count("a=") == HISTORY
        assert rec["decision"] in DECISIONS and rec["decision"] not in rec["context"].split(";")[-1]
        assert 1 <= len(split_sentences(rec["explanation"])) <= 2
        if rec["kind"] == "informative":
            assert rec["implied"] == rec["decision"]
        if rec["kind"] == "misleading":
            assert rec["implied"] != rec["decision"]


def test_records_are_a_function_of_the_seed():
    assert make_records(20, seed=5) == make_records(20, seed=5) != make_records(20, seed=6)
