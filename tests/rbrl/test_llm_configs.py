"""The LLM configs (``configs/rbrl_*_llm.yaml``) end to end: 2 training steps through ``flowkit fit`` against a
loopback server that answers like a chat model, malformed and refusing replies included."""

import json
import logging
from pathlib import Path

import pytest
import torch
from loopback_chat import EMBEDDING_TEXTS, ChatModelServer

from flowkit.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LLM_CONFIGS = sorted(p.name for p in CONFIGS.glob("rbrl_*_llm.yaml"))
BACKEND_PLACES = ("rules.init_args.backend", "judge.init_args.backend", "cot_backend")


def embedding_cache(path: Path) -> Path:
    """Every rule text the server writes, cached: the fit never loads the sentence encoder."""
    gen = torch.Generator().manual_seed(0)
    torch.save({text: torch.randn(16, generator=gen) for text in EMBEDDING_TEXTS}, path)
    return path


def backend_args(base_url: str, **options) -> list[str]:
    """``--data.init_args.<place>.init_args.<option> value`` for the three places the config names its backend."""
    args = []
    for place in BACKEND_PLACES:
        for option, value in {"base_url": base_url, **options}.items():
            args += [f"--data.init_args.{place}.init_args.{option}", str(value)]
    return args


def short_run(config: str, root: Path, base_url: str, *extra: str, **backend_options) -> list[str]:
    """2 training steps after an 8-transition warm-up, 6-step episodes, one evaluation episode."""
    return [
        "fit", "--config", str(CONFIGS / config), "--trainer.default_root_dir", str(root),
        "--data.init_args.embedding_cache", str(embedding_cache(root.parent / f"{root.name}_emb.pt")),
        "--data.init_args.updates_per_epoch", "2", "--model.init_args.warmup_steps", "8",
        "--data.init_args.env_kwargs", json.dumps({"horizon": 6}),
        "--data.init_args.eval_seeds", "[1]", "--data.init_args.eval_episodes", "1", "--data.init_args.eval_envs", "1",
        *backend_args(base_url, **backend_options), *extra,
    ]


def test_hf_config_runs_the_loop_through_a_local_model(tmp_path, capsys):
    """rbrl_wearables_llm_hf.yaml with a tiny saved chat model in place of Llama-3.1-8B-Instruct, on CPU: the loop
    prompts it through its chat template for thoughts and rules; an untrained model writes no valid rule list, so
    the rule source stops the run in one line after 5 such states in a row."""
    import string

    from flowkit.llm.tiny import char_tokenizer, tiny_qwen2

    tokenizer = char_tokenizer(string.printable)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
               max_positions=8192).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    args = short_run("rbrl_wearables_llm_hf.yaml", tmp_path / "run", "unused")
    args = args[: args.index("--data.init_args.rules.init_args.backend.init_args.base_url")]
    for place in BACKEND_PLACES:
        args += [f"--data.init_args.{place}.init_args.model", str(tmp_path / "model"),
                 f"--data.init_args.{place}.init_args.device", "cpu", f"--data.init_args.{place}.init_args.max_new_tokens", "8"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: LLMRuleSource: 5 rule generations in a row failed, the last: no valid rules after 3 attempts" in err
    assert "not valid JSON" in err and "Traceback" not in err


def test_there_is_an_llm_config_per_environment():
    assert {"rbrl_binpacking_llm.yaml", "rbrl_wearables_llm.yaml"} <= set(LLM_CONFIGS)


@pytest.mark.parametrize("config", LLM_CONFIGS)
def test_llm_config_runs_two_training_steps_against_a_chat_model(config, tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO)
    with ChatModelServer(seed=3, malformed=0.2, refusing=0.15) as server:
        main(short_run(config, tmp_path / "run", server.base_url, max_retries=0))
    out = capsys.readouterr().out
    assert "trained selector" in out and "CoT LLM agent (no rules)" in out and "random rule" in out
    run = tmp_path / "run" / "version_0"
    results = json.loads((run / "results.json").read_text())
    assert {"trained selector", "trained selector (sampled)", "random rule", "CoT LLM agent (no rules)"} <= set(results)
    steps = [json.loads(line) for line in (run / "explanations.jsonl").read_text().splitlines()]
    assert len(steps) == 8 + 4 * 2  # warm-up, then one step in each of the 4 envs per training step
    followed = [s for s in steps if s["rule"] is not None and s["rule_reward"] is not None]
    assert followed and all(s["rule"]["rule"].startswith("Rule ") and "I followed the selected rule" in s["explanation"]
                            for s in followed)
    # the official per-call temperatures reached the server: thoughts 0.5, rules 2.0, action and explanation 0.2,
    # the judge's calls before and after the action 0 and 0.2
    temperatures = {}
    for kind, request in zip(server.kinds, server.requests):
        temperatures.setdefault(kind, set()).add(request["temperature"])
    assert temperatures == {"thoughts": {0.5}, "rules": {2.0}, "action": {0.2}, "explanation": {0.2}, "judge": {0.0, 0.2}}
    # the misbehaving replies happened and were handled: rule lists rejected and retried, refusals as null content,
    # judge refusals scored 0 (not yes), invalid actions retried
    assert "rule generation attempt" in caplog.text and "no text (content: null)" in caplog.text
    assert "judge reply does not answer the question(s), scored 0" in caplog.text
