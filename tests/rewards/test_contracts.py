"""The reward-model contract's checks at construction: one line naming the missing or mis-written method."""

import pytest
import torch

from flowkit.errors import ConfigError
from flowkit.modules import PolicyModule
from flowkit.modules.policy_options import FlowPretrainOptions
from flowkit.rewards import FlowReward, PretrainsOnLatents, TokenRewardModel
from flowkit.rewards.base import check_reward_model


class ScoresOnTheModel(TokenRewardModel):  # the contract before step scorers: score on the module, no begin_step
    def score(self, micro, rows):
        return torch.zeros(micro.response_mask.shape)


class MisnamedPretraining(TokenRewardModel):
    percentiles = (0.5,)

    def begin_step(self, step, batch):
        return None

    def pretrain_losses(self, latents, generator):  # no response_mask
        return []


def test_a_model_without_begin_step_is_one_line_naming_it():
    with pytest.raises(ConfigError, match=r"^ScoresOnTheModel must implement begin_step\(step, batch\) -> a step "
                                          r"scorer with score\(micro, rows\)"):
        check_reward_model(ScoresOnTheModel())


def test_an_optional_capability_is_checked_when_the_model_has_it():
    assert isinstance(MisnamedPretraining(), PretrainsOnLatents)
    with pytest.raises(ConfigError, match=r"^MisnamedPretraining\.pretrain_losses\(latents, generator\) cannot be "
                                          r"called as pretrain_losses\(latents, response_mask, generator\)"):
        check_reward_model(MisnamedPretraining())


def test_flow_reward_meets_every_capability_it_is_used_for():
    check_reward_model(FlowReward())
    assert isinstance(FlowReward(), PretrainsOnLatents)


def test_pretraining_a_model_without_pretrain_losses_names_the_method():
    with pytest.raises(ConfigError, match=r"flow_pretrain.steps 5 needs a reward_model with latents to pretrain "
                                          r"\(flowkit\.rewards\.PretrainsOnLatents, e\.g\. a FlowReward\); "
                                          r"ScoresOnTheModel has no pretrain_losses"):
        PolicyModule(reward_model=ScoresOnTheModel(), flow_pretrain=FlowPretrainOptions(steps=5))
