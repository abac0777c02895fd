"""Rule-bottleneck RL (seed 002, §4–5): LLM-written rules, an attention selector trained with discrete SAC.

Plain PyTorch / gymnasium / HF; the Lightning wiring lives in :mod:`flowkit.modules.selector` and
:mod:`flowkit.modules.rule_data`. gymnasium comes with the ``rbrl`` extra (``pip install flowkit[rbrl]``): nothing
else of flowkit imports this package.
"""

from flowkit.errors import ConfigError

try:
    import gymnasium  # noqa: F401
except ImportError as err:
    raise ConfigError(f"the rule-bottleneck method (flowkit.rbrl) needs gymnasium ({err.msg}); install it with "
                      "`pip install flowkit[rbrl]`") from None
