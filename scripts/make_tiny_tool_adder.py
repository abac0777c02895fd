"""Build the bundled tool-calling policy ``flowkit/assets/tiny_tool_adder`` for the ``long_addition`` episodes.

Run from the repository root (deterministic, one thread; minutes on 2 CPU cores)::

    python scripts/make_tiny_tool_adder.py              # build policy and model card
    python scripts/make_tiny_tool_adder.py --measure    # re-measure the bundled policy (the model card's table)

The expert calls the ``add`` tool once per column of the three-operand sum, from the units up, with the column's
digits and the carry read from the previous reply, then boxes the answer assembled from the replies. The model starts
from the bundled ``long_adder``'s weights, which already read the sum's columns. SFT and its stopping rule:
``scripts/tiny_agents.py``.
"""

from __future__ import annotations

import json

from tiny_agents import arguments, make

from flowkit.agents.imitation import Messages


def column_by_column(messages: Messages) -> str:
    """The next turn of the long addition of the conversation's user message: an ``add`` call in the Hermes format
    for the next column, or the boxed sum once every column has a reply."""
    operands = next(content for role, content in messages if role == "user").rstrip("=").split("+")
    replies = [int(content) for role, content in messages if role == "tool"]
    column = len(replies)
    if column < len(operands[0]):
        digits = [int(operand[-1 - column]) for operand in operands]
        carry = replies[-1] // 10 if replies else 0
        call = {"name": "add", "arguments": {"numbers": digits + ([carry] if carry else [])}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"
    # the top column's whole total, then every lower column's units digit
    answer = str(replies[-1]) + "".join(str(reply % 10) for reply in reversed(replies[:-1]))
    return f"\\boxed{{{answer}}}"


MODEL_CARD = """\
# tiny_tool_adder

A {n_params:,}-parameter Qwen2-architecture causal LM (the shape of `tiny_adder`: hidden 128, 4 layers, 4 heads, 2
KV heads, intermediate 512, tied embeddings) with a character-level tokenizer and a chat template, fine-tuned
briefly from `long_adder`'s weights to solve the `long_addition` episodes (three three-digit operands,
`flowkit/assets/long_addition/k3`) by calling the `add` tool once per column in the Hermes / Qwen2.5 format. It is
flowkit's bundled policy for the tool task of the agentic episodes: it knows the format, and it is right in only
some episodes, so RL has room.

Made by `python scripts/make_tiny_tool_adder.py` (seed {seed}).

## Format

The chat template (`flowkit.llm.tiny.CHAT_TEMPLATE`) renders `<bos>`, a system line naming the tools, then each
message as `<|role|>content<eos>`; the policy's turn opens with `<|assistant|>` and ends with the `<eos>` it samples.
`<tool_call>` and `</tool_call>` are tokens of their own (not special: decoding keeps them for the `hermes` parser).
An episode (the tool's replies are rendered by the runner as the template's deltas):

```
<bos><|system|>tools: add<eos><|user|>347+281+905=<eos>
<|assistant|><tool_call>{{"name": "add", "arguments": {{"numbers": [7, 1, 5]}}}}</tool_call><eos><|tool|>13<eos>
<|assistant|><tool_call>{{"name": "add", "arguments": {{"numbers": [4, 8, 0, 1]}}}}</tool_call><eos><|tool|>13<eos>
<|assistant|><tool_call>{{"name": "add", "arguments": {{"numbers": [3, 2, 9, 1]}}}}</tool_call><eos><|tool|>15<eos>
<|assistant|>\\boxed{{1533}}<eos>
```

(line breaks added here). Episode options (`flowkit.agents.evaluate.EPISODE_TASKS["long_addition"]`):
`{options}`; a turn may take {turn_tokens} new tokens.

## Training

The expert's episodes of the {n_train} train records, played through the real `EpisodeRunner` (about {train_tokens}
tokens each), SFT from `long_adder`'s weights (its embedding rows moved to the same characters of this vocabulary;
the tokens it lacks start random: from random weights, 150 steps at lr 0.002 left every validation episode wrong, as
the long adder's column copying had not formed yet) with the loss on the policy's tokens only, AdamW lr {lr}, batch
{batch}, {steps} steps. Every {eval_every} steps, once greedy play won a validation episode, the policy played
{eval_samples} episodes at temperature 1 on each of {eval_records} validation records through the runner and the
`hf` engine; training stopped at the first check with a success rate inside [{low:.2f}, {high:.2f}] (it stopped at
{val:.3f}).

## Measured success (test split, held out)

{records} test records; temperature 1: {n} episodes per record. Measured by
`python scripts/make_tiny_tool_adder.py --measure` (seed {seed}; one thread), which calls
`flowkit.agents.evaluate.episode_success`, as `python scripts/eval_episodes.py --model bundled:tiny_tool_adder
--environment long_addition` does for any checkpoint.

| metric | value |
|---|---|
{table}
"""


if __name__ == "__main__":
    make("tiny_tool_adder", "long_addition", column_by_column,
         arguments(__doc__.splitlines()[0], band=(0.20, 0.50), lr=1e-3, eval_every=20), MODEL_CARD,
         init_from="long_adder")
