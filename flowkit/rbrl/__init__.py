"""Rule-bottleneck RL (seed 002, §4–5): LLM-written rules, an attention selector trained with discrete SAC.

Plain PyTorch / gymnasium / HF; the Lightning wiring lives in :mod:`flowkit.modules.selector` and
:mod:`flowkit.modules.rule_data`.
"""
