"""The selector's reports: the learning curve (``eval_curve.jsonl``, one JSON object per evaluation) and, at the end
of ``fit``, the comparison of the trained selector against uniform-random rule choice and every fixed rule (printed,
and written to ``results.json``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowkit.rbrl import comparison
from flowkit.rbrl.envs import make_env

if TYPE_CHECKING:
    from flowkit.modules.rule_data import RuleEnvDataModule


def append_curve_point(path: Path, point: dict[str, Any]) -> None:
    """One learning-curve evaluation as a line of ``path`` (its directory created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(point) + "\n")


def write_final_report(dm: RuleEnvDataModule, greedy_rule: Callable, sampled_chooser: Callable,
                       directory: Path) -> None:
    """Evaluate, over the DataModule ``dm``'s evaluation seeds, the selector (``greedy_rule``, ``sampled_chooser``)
    against uniform-random rule choice, every fixed rule and the rule-free baselines; print the table — flagging a
    selector that behaves as one fixed rule — and write it to ``directory/results.json``."""
    results, diagnostics = comparison.compare(dm.make_agent(), greedy_rule, sampled_chooser,
                                              dm.eval_seeds, dm.eval_episodes,
                                              list(getattr(dm.source, "rule_names", [])))
    results |= comparison.rule_free_baselines(lambda: make_env(dm.env_name, **dm.env_kwargs), dm.eval_seeds,
                                              dm.eval_episodes, dm.num_envs, dm.batch_size, dm.numeric_sac_steps,
                                              dm.numeric_ppo_transitions, dm.cot_backend)
    table = comparison.format_results(f"RBRL {dm.env_name}", results, dm.eval_seeds, dm.eval_episodes, diagnostics)
    llm_report = [part.report() for part in (dm.source, dm.judge) if hasattr(part, "report")]
    print("\n" + "\n".join([table, *llm_report]), flush=True)
    out = directory / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"eval_seeds": dm.eval_seeds, "llm_report": llm_report,
               "selector_diagnostics": diagnostics | {"same_as_fixed_rule": comparison.same_as_fixed_rule(results, diagnostics)}}
    out.write_text(json.dumps({k: v.tolist() for k, v in results.items()} | summary, indent=1))
