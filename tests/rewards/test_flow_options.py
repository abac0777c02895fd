"""FlowReward's option groups: the protocol presets, explicit keys over them, the next token's entropy, the
pretraining's own condition, and rlfr_qwen_official.yaml as the official preset."""

from pathlib import Path

import pytest
import torch
import yaml

from flowkit.errors import ConfigError
from flowkit.rewards import FlowReward
from flowkit.rewards.flow import LatentOptions, OnlineOptions, PretrainingOptions, ScoringOptions
from flowkit.rewards.flow.options import PRESETS, preset_table
from flowkit.rewards.flow.rejection import next_token_entropy
from backbone_stub import backbone_stub

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def resolved(reward: FlowReward) -> dict[str, object]:
    return {"condition": reward.latents.condition, "normalization": reward.scoring.normalization,
            "online_update": reward.online.online_update, "flow_update": reward.online.flow_update,
            "entropy_of": reward.online.entropy_of, "pretrain_condition": reward.pretraining.pretrain_condition}


def test_each_protocol_fills_the_options_left_null():
    assert resolved(FlowReward()) == resolved(FlowReward(protocol="flowkit")) == {
        "condition": "previous", "normalization": "minmax", "online_update": True, "flow_update": "buffer",
        "entropy_of": "sampled", "pretrain_condition": None}
    assert resolved(FlowReward(protocol="paper")) == {
        "condition": "next", "normalization": "bilateral", "online_update": True, "flow_update": "buffer",
        "entropy_of": "sampled", "pretrain_condition": None}
    assert resolved(FlowReward(protocol="official")) == {
        "condition": "previous", "normalization": "minmax", "online_update": False, "flow_update": "micro_batch",
        "entropy_of": "next", "pretrain_condition": "next"}


def test_an_explicit_key_overrides_the_protocol():
    reward = FlowReward(protocol="official", latents=LatentOptions(condition="next"),
                        scoring=ScoringOptions(normalization="bilateral"), online=OnlineOptions(online_update=True))
    assert resolved(reward) == {"condition": "next", "normalization": "bilateral", "online_update": True,
                                "flow_update": "micro_batch", "entropy_of": "next", "pretrain_condition": "next"}


def test_an_unknown_protocol_is_one_line():
    with pytest.raises(ConfigError, match="FlowReward.protocol must be one of flowkit, paper, official, got 'code'"):
        FlowReward(protocol="code")


def test_the_presets_differ_only_where_paper_and_official_do():
    paper, official = PRESETS["paper"], PRESETS["official"]
    assert paper.keys() == official.keys() == PRESETS["flowkit"].keys()
    for key in paper:
        assert paper[key].keys() == official[key].keys()
        assert any(paper[key][name] != official[key][name] for name in paper[key]), key


def test_the_official_token_entropy_is_the_next_tokens():
    """Official ``entropy_from_logits(logits[:, -num_actions:])``: at token j, the distribution of token j+1; the
    row's last response token (whose next distribution the step never computes) keeps its own."""
    entropy = torch.tensor([[9.0, 1.0, 2.0, 3.0, 9.0], [9.0, 9.0, 4.0, 5.0, 6.0]])
    response = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]])
    shifted = next_token_entropy(entropy, response)
    assert shifted[0, 1:4].tolist() == [2.0, 3.0, 3.0] and shifted[1, 2:].tolist() == [5.0, 6.0, 6.0]


def test_the_online_update_keeps_the_entropy_that_entropy_of_names():
    """The token entropies the entropy quantile will read, kept with each candidate row: the sampled token's, or
    the next token's under ``entropy_of: next``."""
    from test_flow_reward_official import hand_batch, scored_in_micro_batches

    kept = {}
    for entropy_of in ("sampled", "next"):
        reward = FlowReward(latents=LatentOptions(percentiles=(0.25, 0.5)), seed=5,
                            online=OnlineOptions(flow_update="micro_batch", rejection_metric="correct+token_entropy",
                                                 entropy_quantile=0.5, soft_weight=0.25, entropy_of=entropy_of))
        reward.bind(backbone_stub(8), [0.25, 0.5])
        batch = hand_batch()
        entropy = (next_token_entropy(batch.token_entropy, batch.response_mask) if entropy_of == "next"
                   else batch.token_entropy)
        candidates = scored_in_micro_batches(reward, batch, 2).candidates
        kept[entropy_of] = [c.entropy for c in candidates]
        for candidate in candidates:
            torch.testing.assert_close(candidate.entropy, entropy[candidate.row, :len(candidate.mask)])
    assert any(not torch.equal(a, b) for a, b in zip(kept["sampled"], kept["next"]))


def test_the_pretraining_condition_is_its_own(monkeypatch):
    import flowkit.rewards.flow.reward as reward_module

    seen = []
    monkeypatch.setattr(reward_module, "pretraining_loss_pieces", lambda *args: seen.append(args[6]) or [])
    for pretraining, expected in ((PretrainingOptions(), "previous"),
                                  (PretrainingOptions(pretrain_condition="next"), "next")):
        reward = FlowReward(latents=LatentOptions(percentiles=(0.5,)), pretraining=pretraining)
        reward.bind(backbone_stub(8), [0.5])
        reward.pretrain_losses(torch.zeros(1, 1, 3, 8), torch.ones(1, 3), torch.Generator())
        assert seen.pop() == expected


def test_rlfr_qwen_official_runs_the_official_preset():
    """The shipped official config selects the protocol and sets none of the options it decides."""
    config = yaml.safe_load((CONFIGS / "rlfr_qwen_official.yaml").read_text())
    reward = config["model"]["init_args"]["reward_model"]["init_args"]
    assert reward["protocol"] == "official"
    for key, options in PRESETS["official"].items():
        assert not set(options) & set(reward.get(key, {})), key


def test_the_docs_protocol_table_is_the_generated_one():
    text = (ROOT / "docs" / "methods" / "rlfr.md").read_text(encoding="utf-8")
    begin = "<!-- protocol table: generated by flowkit.rewards.flow.options.preset_table -->\n"
    end = "\n<!-- end of the protocol table -->"
    assert text[text.index(begin) + len(begin):text.index(end)] == preset_table()
