"""Supervised fine-tuning on an expert's episodes, for the bundled tiny agents that must know a task's format before
RL (``scripts/make_tiny_tool_adder.py``, ``scripts/make_tiny_guesser.py``).

The expert, ``respond(messages) -> text``, plays the episodes through the real :class:`EpisodeRunner`
(:class:`ExpertPolicy` is its ``generate``), so the traces are the ids RL will see: the same chat template, the
same tool-call text, the environment's and the tools' answers rendered as the same deltas. Each trajectory's
``loss_mask`` puts the loss on the policy's tokens only (:func:`imitation_tensors`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flowkit.agents.episode import Sample
from flowkit.agents.runner import EpisodeOptions, EpisodeRunner
from flowkit.agents.trajectory import Trajectory

Messages = list[tuple[str, str]]  # (role, content) of the conversation so far, the open assistant turn last


class ExpertPolicy:
    """The runner's ``generate`` that answers each episode's turn with ``respond(parse(text so far))``, encoded as
    the tokenizer encodes text, then EOS (log-probs 0, version 0). ``parse`` reads the rendered conversation back
    into messages (special tokens kept)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, respond: Callable[[Messages], str],
                 parse: Callable[[str], Messages]):
        self.tokenizer, self.respond, self.parse = tokenizer, respond, parse

    def __call__(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Sample]:
        samples = []
        for prompt, limit in zip(prompts, max_new_tokens, strict=True):
            text = self.respond(self.parse(self.tokenizer.decode(prompt, skip_special_tokens=False)))
            ids = self.tokenizer.encode(text, add_special_tokens=False)[:limit - 1] + [self.tokenizer.eos_token_id]
            samples.append(Sample(ids, [0.0] * len(ids), [0] * len(ids)))
        return samples


def expert_trajectories(tokenizer: PreTrainedTokenizerBase, respond: Callable[[Messages], str],
                        parse: Callable[[str], Messages], options: EpisodeOptions,
                        records: list[dict[str, Any]]) -> list[Trajectory]:
    """The expert's episode of each record; RuntimeError if one is not a success (the expert or the bounds are
    wrong, and the model would learn that)."""
    trajectories = EpisodeRunner(ExpertPolicy(tokenizer, respond, parse), tokenizer, options).run(records)
    failed = [t for t in trajectories if not (t.done and t.final_reward > 0)]
    if failed:
        raise RuntimeError(f"the expert failed {len(failed)} of {len(trajectories)} episodes; the first ended "
                           f"{failed[0].stop_reason} on {failed[0].record}")
    return trajectories


def imitation_tensors(trajectories: list[Trajectory], pad_token_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels``: each trajectory's ids, with labels -100 where
    ``loss_mask`` is 0 (prompt, environment and tool tokens) and on padding."""
    width = max(len(t.token_ids) for t in trajectories)
    input_ids = torch.full((len(trajectories), width), pad_token_id)
    attention_mask = torch.zeros((len(trajectories), width), dtype=torch.long)
    labels = torch.full((len(trajectories), width), -100)
    for row, trajectory in enumerate(trajectories):
        ids, mask = torch.tensor(trajectory.token_ids), torch.tensor(trajectory.loss_mask, dtype=torch.bool)
        input_ids[row, :len(ids)] = ids
        attention_mask[row, :len(ids)] = 1
        labels[row, :len(ids)] = torch.where(mask, ids, -100)
    return input_ids, attention_mask, labels


def imitate_until(model: PreTrainedModel, tensors: tuple[torch.Tensor, ...], success: Callable[[], float],
                  band: tuple[float, float], lr: float, batch_size: int, max_steps: int, eval_every: int,
                  seed: int) -> tuple[int, float]:
    """SFT (AdamW, batches drawn without replacement with ``seed``) until the first check, every ``eval_every``
    steps, whose ``success()`` lies in ``band`` → (steps, that success). SystemExit when a check jumps past the band
    or none reaches it within ``max_steps``: a policy that is right too often leaves RL nothing to learn."""
    input_ids, attention_mask, labels = tensors
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    order = torch.Generator().manual_seed(seed)
    perm, cursor, started = torch.randperm(len(input_ids), generator=order), 0, time.time()
    for step in range(1, max_steps + 1):
        if cursor + batch_size > len(perm):
            perm, cursor = torch.randperm(len(input_ids), generator=order), 0
        rows = perm[cursor:cursor + batch_size]
        cursor += batch_size
        model.train()
        loss = model(input_ids=input_ids[rows], attention_mask=attention_mask[rows], labels=labels[rows]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % eval_every:
            continue
        rate = success()
        print(f"step {step:5d}  loss {loss.item():.4f}  val success {rate:.3f}  ({time.time() - started:.0f} s)",
              flush=True)
        if band[0] <= rate <= band[1]:
            return step, rate
        if rate > band[1]:
            raise SystemExit(f"validation success jumped past the band to {rate:.3f}; use a smaller --eval-every "
                             "or --lr")
    raise SystemExit(f"no check within {max_steps} steps reached the band {band}")
