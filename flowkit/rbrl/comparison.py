"""How a trained rule selector compares (seed 002 §5): its learning-curve points, and at the end its returns against
uniform-random rule choice, every fixed rule and the rule-free baselines (numeric SAC / PPO on the raw state, a CoT
LLM agent), over fixed evaluation seeds, as a table that flags a selector behaving as one fixed rule."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from flowkit.rbrl.agent import (
    Observation, RuleAgent, StepRecord, evaluate, fixed_rule_chooser, random_chooser, run_episode, selection_diagnostics,
)
from flowkit.llm.chat_backends import ChatBackend
from flowkit.rbrl.language import LanguageEnv
from flowkit.rbrl.llm_source import CoTLLMAgent
from flowkit.rbrl.numeric import NumericPPO, NumericSAC

SAME_AS_FIXED_RULE = 0.99  # action agreement from which the results flag a selector as behaving as a fixed rule

ChooserWithProbs = Callable[[Observation], tuple[int, list[float]]]


def curve_point(agent: RuleAgent, greedy_with_probs: ChooserWithProbs, sample_with_probs: ChooserWithProbs,
                episodes: int, seed_offset: int) -> dict:
    """One learning-curve evaluation: ``episodes`` fixed-seed episodes (seeds ``seed_offset + k``, the same every
    time), played with rules chosen by ``greedy_with_probs`` and again by ``sample_with_probs``, each
    ``choose(obs) -> (index, probabilities)``. Returns the greedy and sampled mean episode returns
    (``episode_return``, ``sampled_return``), the greedy run's mean rule reward and mean entropy of the rule choice
    per step, and its :func:`~flowkit.rbrl.agent.selection_diagnostics` (``chosen``, ``agreement``)."""
    entropies: list[float] = []

    def greedy(obs: Observation) -> int:
        chosen, probs = greedy_with_probs(obs)
        p = np.asarray(probs)
        entropies.append(float(-(p[p > 0] * np.log(p[p > 0])).sum()))
        return chosen

    returns, sampled_returns, records = [], [], []
    for k in range(episodes):
        total, steps = run_episode(agent, greedy, seed_offset + k)
        returns.append(total)
        records += steps
        sampled_returns.append(run_episode(agent, lambda obs: sample_with_probs(obs)[0], seed_offset + k)[0])
    rule_rewards = [r.rule_reward for r in records if r.chosen is not None and r.rule_reward is not None]
    return {
        "episode_return": float(np.mean(returns)),
        "sampled_return": float(np.mean(sampled_returns)),
        "rule_reward": float(np.mean(rule_rewards)) if rule_rewards else 0.0,
        "rule_entropy": float(np.mean(entropies)) if entropies else 0.0,
    } | selection_diagnostics(records)


def compare(agent: RuleAgent, trained_chooser, sampled_chooser_for_seed, seeds: list[int], episodes: int,
            rule_names: list[str]) -> tuple[dict[str, np.ndarray], dict]:
    """Mean return per evaluation seed for the trained selector (greedy ``trained_chooser``; sampled,
    ``sampled_chooser_for_seed(seed)``), random choice and each fixed rule in ``rule_names``, with the greedy
    selector's :func:`~flowkit.rbrl.agent.selection_diagnostics` over those episodes."""
    records: list[StepRecord] = []
    results = {
        "trained selector": evaluate(agent, lambda seed: trained_chooser, seeds, episodes, records),
        "trained selector (sampled)": evaluate(agent, sampled_chooser_for_seed, seeds, episodes),
        "random rule": evaluate(agent, random_chooser, seeds, episodes),
    }
    for name in rule_names:
        results[f"fixed: {name}"] = evaluate(agent, lambda seed, n=name: fixed_rule_chooser(n), seeds, episodes)
    return results, selection_diagnostics(records)


def rule_free_baselines(make_env: Callable[[], LanguageEnv], seeds: list[int], episodes: int, num_envs: int,
                        batch_size: int, numeric_sac_steps: int = 0, numeric_ppo_transitions: int = 0,
                        cot_backend: ChatBackend | None = None) -> dict[str, np.ndarray]:
    """Mean return per evaluation seed of the baselines that choose environment actions without rules: numeric SAC
    for ``numeric_sac_steps`` steps and numeric PPO for ``numeric_ppo_transitions`` transitions (0: not run),
    seeded by torch's initial seed, and a chain-of-thought LLM agent on ``cot_backend`` (None: not run)."""
    seed = int(torch.initial_seed()) % 2**31
    results = {}
    if numeric_sac_steps:
        sac_baseline = NumericSAC(make_env, num_envs=num_envs, batch_size=batch_size, seed=seed)
        sac_baseline.train(numeric_sac_steps)
        results["numeric SAC (raw state, no rules)"] = sac_baseline.evaluate(seeds, episodes)
    if numeric_ppo_transitions:
        ppo = NumericPPO(make_env, num_envs=num_envs, seed=seed)
        ppo.train(numeric_ppo_transitions)
        results["numeric PPO (raw state, no rules)"] = ppo.evaluate(seeds, episodes)
    if cot_backend is not None:
        results["CoT LLM agent (no rules)"] = np.asarray(CoTLLMAgent(cot_backend).evaluate(make_env(), seeds, episodes))
    return results


def same_as_fixed_rule(results: dict[str, np.ndarray], diagnostics: dict) -> list[str]:
    """The fixed rules the trained selector behaved as: its action agreed with the rule's in at least
    ``SAME_AS_FIXED_RULE`` of the evaluation steps, or its returns equal the rule's on every evaluation seed."""
    trained = results["trained selector"]
    same = {name for name, share in diagnostics.get("agreement", {}).items() if share >= SAME_AS_FIXED_RULE}
    same |= {k[len("fixed: "):] for k, v in results.items() if k.startswith("fixed: ") and np.allclose(v, trained, rtol=0, atol=1e-9)}
    return sorted(same)


def format_results(title: str, results: dict[str, np.ndarray], seeds: list[int], episodes: int, diagnostics: dict | None = None) -> str:
    lines = [
        f"{title}: mean episode return ± std over {len(seeds)} evaluation seeds {seeds} ({episodes} episodes each)",
        f"{'policy':32s} {'mean':>9s} {'± std':>8s}   per-seed means",
    ]
    for name, per_seed in sorted(results.items(), key=lambda kv: -kv[1].mean()):
        per = " ".join(f"{v:8.3f}" for v in per_seed)
        lines.append(f"{name:32s} {per_seed.mean():9.3f} {per_seed.std(ddof=1) if len(per_seed) > 1 else 0.0:8.3f}   {per}")
    if diagnostics:
        percent = lambda shares: ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
        if diagnostics.get("chosen"):
            lines.append(f"trained selector (greedy) chose: {percent(diagnostics['chosen'])}")
        if diagnostics.get("agreement"):
            lines.append(f"its action agreed with each fixed rule's: {percent(diagnostics['agreement'])}")
        same = same_as_fixed_rule(results, diagnostics)
        if same:
            shares = diagnostics.get("agreement", {})
            which = ", ".join(f"{name} ({100 * shares[name]:.1f}% of its actions)" if name in shares else f"{name} (same returns)"
                              for name in same)
            lines.append(f"WARNING: the trained selector behaves as the fixed rule(s) {which}, not as a learned choice among rules")
    return "\n".join(lines)
