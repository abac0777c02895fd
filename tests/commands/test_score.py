"""`flowkit score` on agent episodes (docs/guides/agents.md, "Scoring episodes"): a fit's completion log re-scored
from the ids it logged, the policy's tokens scored and the environment's only conditioning them; pairs and episodes
in one input; bad episode records refused in one line before any work."""

from __future__ import annotations

import copy
import json
import re

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from flowkit.agents import EpisodeOptions
from flowkit.commands.score import score
from flowkit.data.records import RecordError
from flowkit.modules import CompletionLogs, PolicyModule, RolloutDataModule
from flowkit.modules.policy_options import FlowPretrainOptions, SamplingOptions
from flow_options import flow_reward

PROMPT = "<|system|>tools: add<eos><|user|>369+646+593=<eos><|assistant|>"  # the tokenizer adds its <bos>
TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"numbers": [9, 6, 3]}}</tool_call><eos>'


def tool_adder() -> PolicyModule:
    """The bundled tool-calling policy with a fresh flow reward over its latents, as configs/rlfr_tools_tiny.yaml
    (eta 0: every token above its row's least deviation is penalised, so each reward moves with its deviation)."""
    return PolicyModule(backbone="bundled:tiny_tool_adder", outcome_reward="none",
                        reward_model=flow_reward(percentiles=[0.25], depth=1, condition="previous", eta=0.0, seed=0),
                        sampling=SamplingOptions(num_samples=2, max_new_tokens=64),
                        flow_pretrain=FlowPretrainOptions(steps=0),
                        episodes=EpisodeOptions("long_addition", tool_parser="hermes", max_turns=6, max_tokens=320))


def episode(tool_reply: str) -> dict:
    return {"prompt": PROMPT, "episode": {"turns": [
        {"role": "policy", "text": TOOL_CALL}, {"role": "tool", "text": f"<|tool|>{tool_reply}<eos><|assistant|>"},
        {"role": "policy", "text": "\\boxed{1608}<eos>"}]}}


def scored(tmp_path, module, records: list[dict], name: str = "scores") -> list[dict]:
    source, output = tmp_path / f"{name}_input.jsonl", tmp_path / f"{name}.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    score(None, module, None, input=str(source), output=str(output), html_output=str(tmp_path / f"{name}.html"))
    return [json.loads(line) for line in output.read_text().splitlines()]


def test_a_fits_completion_log_rescored_with_its_weights_gives_the_trainings_flow_rewards(tmp_path, single_thread):
    L.seed_everything(0, verbose=False)
    module = tool_adder()
    data = RolloutDataModule(train_path="bundled:long_addition/k3/train.jsonl", val_path=None, prompt_format="text",
                             batch_size=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, num_sanity_val_steps=0, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, logger=CSVLogger(tmp_path, name=""),
                        callbacks=[CompletionLogs(every_n_steps=1, rows=2)])
    sampled_with = copy.deepcopy(module.state_dict())
    trainer.fit(module, datamodule=data)
    module.load_state_dict(sampled_with)  # the weights that sampled and scored the step
    log = tmp_path / "version_0" / "completions.jsonl"
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(turn["role"] == "tool" for row in logged for turn in row["episode"]["turns"])  # a multi-turn episode
    for row in logged:  # the log carries the sampled ids, and they are its text
        assert module.tokenizer.decode(row["prompt_ids"], skip_special_tokens=False) == row["prompt"]
        for turn in row["episode"]["turns"]:
            assert len(turn["ids"]) == turn["tokens"]
            assert module.tokenizer.decode(turn["ids"], skip_special_tokens=False) == turn["text"]

    page = tmp_path / "scores.html"
    score(None, module, None, input=str(log), output=str(tmp_path / "scores.jsonl"), html_output=str(page))
    rows = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert len(rows) == len(logged)
    for row, log_row in zip(rows, logged):
        assert row["episode"] == log_row["episode"] and row["roles"] == log_row["roles"]
        assert row["tokens"] == log_row["tokens"]
        for role, reward, deviation in zip(row["roles"], row["rewards"], row["deviations"]):
            assert (reward is None and deviation is None) == (role != "policy")
        # the log holds the step's whole batch in order (one prompt, 2 samples) and the noise step is the step's
        # (prompt batch index 0): the rewards are the training's, its environment tokens' zeros left out
        assert [reward or 0.0 for reward in row["rewards"]] == pytest.approx(log_row["token_rewards"], abs=1e-7)
        assert any(reward < 0 for reward in row["rewards"] if reward is not None)
    assert "class='tool' title='tool: not scored'" in page.read_text()


def test_environment_tokens_condition_the_later_policy_tokens_and_are_never_scored(tmp_path, single_thread):
    module = tool_adder()
    (row,) = scored(tmp_path, module, [episode("18")], "right")
    (changed,) = scored(tmp_path, module, [episode("17")], "wrong")  # the tool's reply, same length
    roles = row["roles"]
    tool = roles.index("tool")
    after = [k for k in range(tool, len(roles)) if roles[k] == "policy"]
    assert roles == ["policy"] * tool + ["tool"] * 5 + ["policy"] * len(after)
    assert row["tokens"][tool:tool + 5] == ["<|tool|>", "1", "8", "<eos>", "<|assistant|>"]  # its text, encoded
    assert all(row[key][k] is None for key in ("rewards", "deviations") for k in range(tool, tool + 5))
    assert all(isinstance(row["rewards"][k], float) for k in [*range(tool), *after])
    # R_CFM is per token: the policy's tokens before the reply are unchanged, the ones after it read the reply
    # (the rewards are normalised over the row, so any token's may move with the row's extremes).
    assert changed["deviations"][:tool] == row["deviations"][:tool]
    assert all(changed["deviations"][k] != row["deviations"][k] for k in after)
    assert [changed["rewards"][k] for k in after] != [row["rewards"][k] for k in after]


def test_pairs_and_episodes_mix_and_a_bad_episode_is_one_line_naming_its_record_before_any_work(tmp_path,
                                                                                               single_thread):
    module = tool_adder()
    pair = {"prompt": PROMPT, "response": TOOL_CALL.removesuffix("<eos>")}
    rows = scored(tmp_path, module, [pair, episode("18")])
    assert rows[0]["response"] == pair["response"] and set(rows[0]["roles"]) == {"policy"}
    assert rows[0]["tokens"] == rows[1]["tokens"][:len(rows[0]["tokens"])]  # the pair's response, then <eos>
    assert all(reward is not None for reward in rows[0]["rewards"])

    bad = [({**episode("18"), "episode": {"turns": []}}, "a non-empty list of 'turns'"),
           ({"prompt": PROMPT, "episode": {"turns": [{"role": "policy"}]}}, "turn 0 of the episode needs a 'role'"),
           ({"prompt": PROMPT, "episode": {"turns": [{"role": "user", "text": "hi"}]}}, "needs a 'role'"),
           ({"prompt": PROMPT, "episode": {"turns": [{"role": "tool", "text": "<|tool|>1"}]}}, "has no policy turn"),
           ({**episode("18"), "prompt_ids": [1, 10**6]}, r"prompt_ids must be a list of token ids in \[0, 105\)"),
           ({**episode("18"), "response": "5"}, "either a 'response' or an 'episode', got both"),
           ({"prompt": PROMPT}, "got neither")]
    for record, message in bad:
        source = tmp_path / "bad.jsonl"
        source.write_text(json.dumps(pair) + "\n" + json.dumps(record) + "\n")
        with pytest.raises(RecordError, match=f"^{re.escape(str(source))}:2: .*{message}") as error:
            score(None, module, None, input=str(source), output=str(tmp_path / "never.jsonl"),
                  checkpoint=str(tmp_path / "never-read.ckpt"))  # refused before the checkpoint is read
        assert "\n" not in str(error.value)
    assert not (tmp_path / "never.jsonl").exists()
