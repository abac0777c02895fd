"""A FlowReward from options named as single keywords (``kappa=1``), for tests that vary a few of them: each goes into
the group :data:`FlowReward.MOVED_OPTIONS <flowkit.rewards.flow.reward.MOVED_OPTIONS>` names (``online.kappa``); the
others (``protocol``, ``seed``, ``weights``) are FlowReward's own."""

from __future__ import annotations

from typing import Any

from flowkit.rewards import FlowReward
from flowkit.rewards.flow.options import GROUPS


def flow_reward(**options: Any) -> FlowReward:
    grouped: dict[str, dict[str, Any]] = {}
    own = {}
    for name, value in options.items():
        if name in FlowReward.MOVED_OPTIONS:
            key, _, field = FlowReward.MOVED_OPTIONS[name].partition(".")
            grouped.setdefault(key, {})[field] = value
        else:
            own[name] = value
    return FlowReward(**own, **{key: GROUPS[key](**fields) for key, fields in grouped.items()})
