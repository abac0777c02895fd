"""`flowkit explain-rules`: one episode of a trained rule selector, step by step — the candidate rules
with their selection probabilities, the chosen rule, the action and its explanation (seed 002 Alg. 1)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flowkit.registry import subcommand

if TYPE_CHECKING:  # RBRL's modules import when the command runs: every `flowkit` command registers this one
    from flowkit.modules.rule_data import RuleEnvDataModule
    from flowkit.modules.selector import SelectorModule
    from flowkit.rbrl.agent import StepRecord


def latest_checkpoint(root: str | Path) -> Path | None:
    found = sorted(Path(root).glob("**/checkpoints/*.ckpt"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def format_step(record: StepRecord) -> str:
    lines = [f"step {record.t}: {record.state_text}"]
    for i, rule in enumerate(record.rules):
        marker = "→" if i == record.chosen else " "
        prob = f"{record.probabilities[i]:.2f}" if record.probabilities else "  - "
        lines.append(f"  {marker} p={prob} {rule['rule']}")
    lines.append(f"  action: {record.action_text}")
    lines.append(f"  explanation: {record.explanation}")
    rule = "none (not judged)" if record.rule_reward is None else f"{record.rule_reward:.2f}"
    lines.append(f"  reward: env {record.env_reward:+.3f}, rule {rule}")
    return "\n".join(lines)


@subcommand("explain-rules")
def explain_rules(
    trainer, model: SelectorModule, datamodule: RuleEnvDataModule, ckpt_path: str | None = None, seed: int = 1
) -> str:
    """Print one evaluation episode of the trained selector (greedy rule choice) with rules and explanations.

    Args:
        ckpt_path: checkpoint to explain; default: the newest one under the trainer's default_root_dir.
        seed: episode seed.
    """
    from flowkit.rbrl.agent import run_episode

    ckpt = Path(ckpt_path) if ckpt_path else latest_checkpoint(trainer.default_root_dir)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint under {trainer.default_root_dir}; run `flowkit fit` first or pass --ckpt_path")
    datamodule.trainer = trainer
    datamodule.setup("predict")
    model.build_networks(datamodule.state_dim, datamodule.embed_dim)
    model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"])
    model.eval()

    agent = datamodule.make_agent()
    probabilities: dict[int, list[float]] = {}  # step → selection probabilities

    def choose(obs):
        probabilities[agent.t] = model.rule_log_probs(obs).exp().tolist()
        return model.greedy_rule(obs)

    total, records = run_episode(agent, choose, seed)
    for record in records:
        record.probabilities = probabilities.get(record.t, [])
    report = "\n\n".join(format_step(r) for r in records)
    report += f"\n\nepisode return (environment): {total:.3f}   checkpoint: {ckpt}"
    print(f"Task: {agent.env.task}\n\n{report}")
    return report
