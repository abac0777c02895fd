"""Does the official RLFR online update move the flow? Run it under the official pins (transformers 4.50):

    python -m venv /tmp/officialvenv && /tmp/officialvenv/bin/pip install torch "transformers==4.50.*"
    /tmp/officialvenv/bin/python scripts/official_flow_gradient.py

The official actor (``openrlhf/models/actor.py`` of Jinghaoleven/RLFR) computes its flow loss in a forward hook on
decoder blocks; every official script passes ``--gradient_checkpointing_use_reentrant``, so transformers runs each
block's ``__call__`` (hooks included) inside ``torch.utils.checkpoint(use_reentrant=True)``, whose forward runs
under ``no_grad``. The trainer then sets ``action_flow_loss.requires_grad = True`` (``ppo_trainer.py``, the online
flow update) and backpropagates it. This script builds a tiny Qwen2 from its config (no download), hooks a block
the same way (the condition latent detached, the target not, as the official ``forward_hook``) with a linear
stand-in for the velocity field, and prints, for reentrant and non-reentrant checkpointing, whether the flow loss
has a graph and whether the flow's parameters get a gradient. Under the official setting they get none: the flow
never moves after its offline pretraining, which is why ``FlowReward(protocol="official")`` freezes it
(docs/methods/rlfr.md). Exit status 0 when that holds (and the non-reentrant control does train the flow).
"""

from __future__ import annotations

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM


def flow_gradient(use_reentrant: bool) -> dict[str, object]:
    """One official actor step on a tiny Qwen2: the policy's backward, then the flow loss's (``requires_grad = True``
    as the official trainer sets it). Returns whether the hooked flow loss had a graph and the flow's gradient."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    model = Qwen2ForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    flow = torch.nn.Linear(config.hidden_size, config.hidden_size)  # the velocity field's stand-in
    flow_losses = []

    def forward_hook(module, inputs, output):  # as the official Actor_Flow.forward_hook, ``token_post``
        hidden = output[0]
        context, target = hidden[:, :-1].detach(), hidden[:, 1:]
        flow_losses.append((flow(context) - target).pow(2).mean(-1))
        return output

    model.model.layers[1].register_forward_hook(forward_hook)
    sequences = torch.randint(0, config.vocab_size, (2, 12))
    output = model(sequences, attention_mask=torch.ones_like(sequences))
    flow_loss = flow_losses.pop(0).mean()  # the forward's own loss (a reentrant backward appends a recomputed one)
    had_graph = flow_loss.grad_fn is not None
    # The policy's backward (``strategy.backward(loss, actor.model, ...)``); its graph is kept for the control, whose
    # flow loss shares the hooked block's output with it.
    output.logits.float().mean().backward(retain_graph=True)
    if not flow_loss.requires_grad:
        flow_loss.requires_grad = True  # ppo_trainer.py: ``action_flow_loss.requires_grad = True``
    flow_loss.backward()
    grad = flow.weight.grad
    return {"flow loss has a graph": had_graph, "flow loss is a leaf": flow_loss.grad_fn is None,
            "flow gradient": None if grad is None else float(grad.abs().sum())}


def main() -> int:
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    official, control = flow_gradient(use_reentrant=True), flow_gradient(use_reentrant=False)
    print("use_reentrant=True  (--gradient_checkpointing_use_reentrant, every official script):", official)
    print("use_reentrant=False (control):", control)
    frozen = not official["flow loss has a graph"] and not official["flow gradient"]
    trained = control["flow loss has a graph"] and bool(control["flow gradient"])
    print("the official online update leaves the flow unchanged" if frozen else "the official flow loss has a graph")
    return 0 if frozen and trained else 1


if __name__ == "__main__":
    raise SystemExit(main())
