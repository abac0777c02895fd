"""Build the bundled policy ``flowkit/assets/tiny_guesser`` for the ``guess_number`` episodes.

Run from the repository root (deterministic, one thread; minutes on 2 CPU cores)::

    python scripts/make_tiny_guesser.py              # build policy and model card
    python scripts/make_tiny_guesser.py --measure    # re-measure the bundled policy (the model card's table)

The expert plays binary search: each guess is the middle of the range the answers so far leave ("higher" after a
guess raises the low end past it, "lower" drops the high end below it), so every action depends on the
observations. SFT and its stopping rule: ``scripts/tiny_agents.py``.
"""

from __future__ import annotations

import re

from tiny_agents import arguments, make

from flowkit.agents.envs.long_addition import boxed_answer
from flowkit.agents.imitation import Messages


def binary_search(messages: Messages) -> str:
    """The next guess, ``\\boxed{n}``: the middle of the range left by the game's answers so far."""
    prompt = next(content for role, content in messages if role == "user")
    low, high = map(int, re.search(r"from (\d+) to (\d+)", prompt).groups())
    guess = None
    for role, content in messages:
        if role == "assistant" and content:
            guess = int(boxed_answer(content))
        elif role == "user" and guess is not None:
            low, high = (guess + 1, high) if content == "higher" else (low, guess - 1)
    return f"\\boxed{{{(low + high) // 2}}}"


MODEL_CARD = """\
# tiny_guesser

A {n_params:,}-parameter Qwen2-architecture causal LM (the shape of `tiny_adder`: hidden 128, 4 layers, 4 heads,
2 KV heads, intermediate 512, tied embeddings) with a character-level tokenizer and a chat template, fine-tuned
briefly to play the `guess_number` episodes: find a hidden number from 1 to 100 in 7 guesses from the environment's
"higher" / "lower" answers. It is flowkit's bundled policy for the stateful-environment task of the agentic episodes:
each guess has to depend on the answers so far; it knows the format and finds the number in only some episodes, so
RL has room.

Made by `python scripts/make_tiny_guesser.py` (seed {seed}).

## Format

The chat template (`flowkit.llm.tiny.CHAT_TEMPLATE`) renders `<bos>`, then each message as `<|role|>content<eos>`;
the policy's turn opens with `<|assistant|>` and ends with the `<eos>` it samples. An episode (the environment's
answers are rendered by the runner as the template's deltas):

```
<bos><|user|>Guess my number from 1 to 100, as \\boxed{{n}}. You have 7 guesses.<eos>
<|assistant|>\\boxed{{50}}<eos><|user|>higher<eos>
<|assistant|>\\boxed{{75}}<eos><|user|>lower<eos>
<|assistant|>\\boxed{{62}}<eos>
```

(line breaks added here). Episode options (`flowkit.agents.evaluate.EPISODE_TASKS["guess_number"]`):
`{options}`; a turn may take {turn_tokens} new tokens. The games are draws of the secret
(`guess_number_records`): train, validation and test are the draws of seeds 0, 1 and 2
(`flowkit.agents.evaluate.GUESS_SPLITS`); with 100 possible secrets they hold the same games, so "held out" means
other draws, and the measure is how often the policy plays a game through, not whether it saw the secret.

## Training

The expert's episodes of the {n_train} train games, played through the real `EpisodeRunner` (about {train_tokens}
tokens each), SFT from random initialisation with the loss on the policy's tokens only, AdamW lr {lr}, batch
{batch}, {steps} steps. Every {eval_every} steps, once greedy play won a validation episode, the policy played
{eval_samples} episodes at temperature 1 on each of {eval_records} validation games through the runner and the `hf`
engine; training stopped at the first check with a success rate inside [{low:.2f}, {high:.2f}] (it stopped at
{val:.3f}).

## Measured success (test games)

{records} test games; temperature 1: {n} episodes per game. Measured by
`python scripts/make_tiny_guesser.py --measure` (seed {seed}; one thread), which calls
`flowkit.agents.evaluate.episode_success`, as `python scripts/eval_episodes.py --model bundled:tiny_guesser
--environment guess_number` does for any checkpoint.

| metric | value |
|---|---|
{table}
"""


if __name__ == "__main__":
    make("tiny_guesser", "guess_number", binary_search,
         arguments(__doc__.splitlines()[0], band=(0.20, 0.50), lr=2e-3, eval_every=25), MODEL_CARD)
