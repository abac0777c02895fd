"""The bundled tiny agents play their tasks through the real episode runner, the ``hf`` engine's token-in path and the
real environments: the format they were taught parses (tool calls recognised, guesses boxed), each action follows
the observations, episodes end; and the success measurement is a function of its seed."""

from __future__ import annotations

import pytest
import torch

from flowkit.agents import EpisodeRunner, engine_generate
from flowkit.agents.envs.long_addition import boxed_answer
from flowkit.agents.evaluate import EPISODE_TASKS, episode_success
from flowkit.llm.backbone import load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine


def play(name: str, environment: str, records: int, temperature: float):
    model, tokenizer = load_backbone(f"bundled:{name}")
    task = EPISODE_TASKS[environment]
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=task.turn_tokens, temperature=temperature)
    torch.manual_seed(0)
    trajectories = EpisodeRunner(engine_generate(engine), tokenizer, task.options).run(task.records("test")[:records])
    return trajectories, tokenizer


def test_tiny_tool_adder_calls_add_once_per_column_then_answers(single_thread):
    trajectories, tokenizer = play("tiny_tool_adder", "long_addition", 8, temperature=0.0)
    for trajectory in trajectories:
        assert trajectory.done and trajectory.counters["tool_calls"] == 3 and trajectory.counters["tool_errors"] == 0
        assert [turn.role for turn in trajectory.turns] == ["prompt"] + ["policy", "tool"] * 3 + ["policy"]
        answer = tokenizer.decode(trajectory.token_ids[trajectory.turns[-1].start:])
        assert trajectory.final_reward == float(boxed_answer(answer) == trajectory.record["answer"])


def test_tiny_guesser_boxes_each_guess_and_follows_the_answers(single_thread):
    trajectories, tokenizer = play("tiny_guesser", "guess_number", 8, temperature=0.0)
    for trajectory in trajectories:
        assert trajectory.done and 1 <= len(trajectory.policy_turns()) <= 7
        guesses = [int(boxed_answer(tokenizer.decode(trajectory.token_ids[turn.start:turn.end])))
                   for turn in trajectory.policy_turns()]
        secret = trajectory.record["secret"]
        assert guesses[0] == 50 and trajectory.final_reward == float(secret in guesses)
        if len(guesses) > 1:  # the second guess is on the side of 50 the environment pointed to
            assert (guesses[1] > 50) == (secret > 50)


@pytest.mark.parametrize("name, environment", [("tiny_tool_adder", "long_addition"),
                                               ("tiny_guesser", "guess_number")])
def test_episode_success_samples_the_bundled_agents_reproducibly(single_thread, name, environment):
    model, tokenizer = load_backbone(f"bundled:{name}")
    task = EPISODE_TASKS[environment]
    records = task.records("test")[:4]
    first = episode_success(model, tokenizer, task, records, samples=3, temperature=1.0, seed=1)
    assert first == episode_success(model, tokenizer, task, records, samples=3, temperature=1.0, seed=1)
    assert first["episodes/done_rate"] + first["episodes/truncated_rate"] == 1.0
    assert first["episodes/success_rate"] <= first["episodes/pass@3"]
