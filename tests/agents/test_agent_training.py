"""Agent episodes in the RL step: make_experience runs the episode runner over the engine's token-in path and trains
on the policy's tokens only. The mask test adds noise to everything the step computes or reads at the environment's
tokens (old, rollout and reference log-probs, entropies, values, latents) and finds the advantages, the losses, the
rollout corrections, the flow rewards, the flow loss and every gradient unchanged."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch
from agent_fakes import ScriptedPolicy, drift_tokenizer
from transformers import Qwen2Config, Qwen2ForCausalLM

from flowkit.agents import ENVIRONMENTS, EnvStep, EpisodeOptions
from flowkit.agents.envs.long_addition import add, boxed_answer
from flowkit.errors import ConfigError, RunError
from flowkit.llm.latent_tap import LatentTap
from flowkit.llm.rollout_engine import TokenRollouts
from flowkit.rewards import FlowReward
from flowkit.rewards.flow.options import LatentOptions, NetworkOptions, OnlineOptions, ScoringOptions
from flowkit.rl.rollout_correction import RolloutCorrection
from flowkit.step import (
    Actor, ActorOutput, AdvantageOptions, ExperienceMaker, Grader, KLReference, LossOptions, NonFiniteStep,
    PolicyUpdate, PromptBatch, SamplingControls, UpdateOptions,
)
from flowkit.step.episodes import EpisodeRollout

HANG = threading.Event()  # what a hanging call waits for; set when the test ends, so its daemon thread finishes


def flood() -> str:
    """A reply of 10 MB."""
    return "x" * 10_000_000


class ToolSum:
    """Add the record's numbers with the ``add`` tool and box the sum; reward 1 for it. ``record["fault"]`` makes
    ``reset`` or ``step`` fail."""

    tools = (add, flood)

    def reset(self, record):
        self.record = record
        if record.get("fault") == "reset_raises":
            raise RuntimeError("the sandbox did not start")
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, action):
        fault = self.record.get("fault")
        if fault == "step_hangs":
            HANG.wait(60)
        if fault == "not_a_string":
            return EnvStep([{"role": "user", "content": 42}])
        return EnvStep([], reward=float(boxed_answer(action) == self.record["answer"]), done=True)


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def policy_script(tool_text=None):
    """The policy: a tool call first (``tool_text``, default add(2, 3)), then a boxed answer, wrong on every third
    answer it gives (so a group's rewards differ)."""
    answers = iter(range(1_000))

    def respond(messages):
        if not any(role == "tool" for role, _ in messages):
            return tool_text or call("add", numbers=[2, 3])
        return "\\boxed{6}" if next(answers) % 3 == 2 else "\\boxed{5}"

    return respond


class ScriptedEngine:
    """A rollout engine with only the token-in path: the scripted policy's turns (non-zero log-probs)."""

    saw_nonfinite_logits, lockstep = False, False
    policy_version = 3

    def __init__(self, tokenizer, respond):
        self.tokenizer, self.script = tokenizer, ScriptedPolicy(tokenizer, respond)

    def generate_from_ids(self, prompts, max_new_tokens, temperature=None) -> TokenRollouts:
        samples = self.script(prompts, max_new_tokens)
        return TokenRollouts([list(s.ids) for s in samples], [list(s.logprobs) for s in samples],
                             [[self.policy_version] * len(s.ids) for s in samples])

    def generate(self, prompts, n=1, answers=None, temperature=None):
        raise AssertionError("episodes generate token-in only")

    def sync_weights(self, model, version) -> None:
        self.policy_version = version

    def close(self) -> None:
        pass


class RecordedRollout(EpisodeRollout):
    """Keeps which tokens of its rows are the environment's, as the trajectories say (not as the step's masks do)."""

    def generate(self, prompts, n, device):
        batch, trajectories, nonfinite = super().generate(prompts, n, device)
        self.environment_tokens = batch.response_mask - batch.policy_mask
        return batch, trajectories, nonfinite


class EnvironmentNoise(Actor):
    """The real actor, plus ``noise`` × a fixed pattern on what it computes at the environment's tokens — log-probs
    (another pattern under gradient: the update's π_θ and the scoring pass's π_old differ there), entropies, values,
    latents and reference log-probs."""

    noise = 0.0
    rollout: RecordedRollout

    def _pattern(self, like: torch.Tensor, salt: int) -> torch.Tensor:
        environment = self.rollout.environment_tokens[:like.shape[0], :like.shape[-1]]
        waves = torch.sin(torch.arange(like.shape[-1]) * (1.3 + salt)).expand_as(environment)
        return self.noise * waves * environment

    def forward(self, batch, tap=False, temperature=None):
        out = super().forward(batch, tap, temperature)
        out.logprobs = out.logprobs + self._pattern(out.logprobs, 2 if torch.is_grad_enabled() else 1)
        out.entropy = out.entropy + self._pattern(out.entropy, 3).abs()
        if out.values is not None:
            out.values = out.values + self._pattern(out.values, 4)
        if out.latents is not None:
            out.latents = out.latents + self._pattern(out.latents[..., 0], 5)[None, ..., None]
        return out

    def reference_logprobs(self, batch):
        return super().reference_logprobs(batch) + self._pattern(batch.input_ids.float(), 6)


class GradientRecorder:
    """A StepOptimizer that keeps each backward's loss and, at each step, every gradient; it moves nothing."""

    def __init__(self, modules):
        self.parameters = [p for module in modules for p in module.parameters()]
        self.losses, self.gradients = [], []

    def backward(self, loss):
        self.losses.append(float(loss.detach()))
        loss.backward()

    def nonfinite(self, groups):
        return []

    def step(self, groups):
        self.gradients.append([None if p.grad is None else p.grad.clone() for p in self.parameters])
        for p in self.parameters:
            p.grad = None


def tiny_policy(tokenizer):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(config)


RECORDS = PromptBatch(["What is 2+3?", "Add 2 and 3."], ["5", "5"])
CASES = {
    "grpo-ppo-token_tis-kl_loss": (dict(estimator="grpo"), dict(policy_loss="ppo", kl_coef=0.1, entropy_coef=0.01,
                                                                 rollout_correction=RolloutCorrection("token_tis"))),
    "rloo-gspo-seq_tis-off_policy": (dict(estimator="rloo"), dict(
        policy_loss="gspo", rollout_correction=RolloutCorrection("seq_tis", off_policy_mask=0.0))),
    "gae-cispo-seq_mis-kl_reward": (dict(estimator="gae"), dict(
        policy_loss="cispo", kl_coef=0.1, kl_in="reward", rollout_correction=RolloutCorrection("seq_mis", cap=50.0))),
    "reinforce-entropy_adv-bypass-seq_mean": (dict(estimator="reinforce", entropy_alpha=0.4), dict(
        aggregation="seq-mean", rollout_correction=RolloutCorrection(bypass=True))),
    "grpo-icepop-dr_grpo": (dict(estimator="grpo"), dict(aggregation="dr-grpo",
                                                          rollout_correction=RolloutCorrection("icepop"))),
}


def run_step(tokenizer, noise, advantage, loss):
    """One RL step over episodes of ``test_tool_sum`` with the flow reward: the experience, the update's statistics
    and the recorder (losses and gradients)."""
    policy = tiny_policy(tokenizer)
    reward = FlowReward(latents=LatentOptions(percentiles=(0.5,), condition="next"), network=NetworkOptions(depth=1),
                        scoring=ScoringOptions(normalization="minmax"),
                        online=OnlineOptions(kappa=1, flow_update="micro_batch"), seed=0)
    tap = LatentTap(policy, reward.percentiles)
    reward.bind(policy, tap.layer_positions, tokenizer)
    options = AdvantageOptions(**advantage)
    value_head = torch.nn.Linear(32, 1) if options.estimator == "gae" else None
    reference = KLReference(policy, tiny_policy(tokenizer)) if loss.get("kl_coef") else None
    actor = EnvironmentNoise(policy, tap, value_head, reference, UpdateOptions(), LossOptions(**loss).with_budget(64))
    actor.noise = noise
    engine = ScriptedEngine(tokenizer, policy_script())
    actor.rollout = RecordedRollout(engine, tokenizer, EpisodeOptions("test_tool_sum", batch_window=5.0))
    maker = ExperienceMaker(actor, engine, Grader("none"), reward, options, UpdateOptions(), SamplingControls(), 3,
                            episodes=actor.rollout)
    experience = maker.make_experience(RECORDS, 0)
    environment = actor.rollout.environment_tokens.bool()
    rollout = experience.rollout_logprobs + noise * environment * 7.0
    experience = dataclasses.replace(experience, rollout_logprobs=rollout)
    recorder = GradientRecorder([policy, reward] + ([value_head] if value_head is not None else []))
    stats = PolicyUpdate(actor, UpdateOptions()).train_on(experience, recorder)
    return experience, stats, recorder


@pytest.fixture(scope="module")
def tokenizer():
    return drift_tokenizer()


@pytest.fixture(scope="module", autouse=True)
def tool_sum_environment():
    """Registered while this module's tests run only (the option reference lists the registry's environments)."""
    ENVIRONMENTS["test_tool_sum"] = ToolSum
    yield
    del ENVIRONMENTS["test_tool_sum"]


@pytest.mark.parametrize("case", CASES)
def test_noise_on_environment_tokens_changes_no_advantage_loss_correction_flow_reward_or_gradient(tokenizer, case,
                                                                                                   single_thread):
    clean, clean_stats, clean_grads = run_step(tokenizer, 0.0, *CASES[case])
    noisy, noisy_stats, noisy_grads = run_step(tokenizer, 3.0, *CASES[case])
    environment = (clean.response_mask - clean.loss_mask).bool()
    assert environment.sum() > 10 and clean.loss_mask.sum() > 10  # both kinds of token are there
    assert clean.advantages.abs().sum() > 0 and not clean.advantages[environment].any()
    assert not clean.token_rewards[environment].any() and clean.token_rewards.abs().sum() > 0
    for name in ("advantages", "returns", "token_rewards"):
        if getattr(clean, name) is not None:
            torch.testing.assert_close(getattr(noisy, name), getattr(clean, name), msg=name)
    assert noisy_stats.keys() == clean_stats.keys()
    assert any(key.startswith("rollout_corr/") for key in clean_stats) and "flow/loss" in clean_stats
    for key, value in clean_stats.items():
        if not key.startswith("time/"):
            torch.testing.assert_close(torch.as_tensor(noisy_stats[key]).float(), torch.as_tensor(value).float(),
                                       msg=key)
    assert noisy_grads.losses == pytest.approx(clean_grads.losses)
    assert any(g is not None and g.abs().sum() > 0 for g in clean_grads.gradients[0])
    for noisy_grad, clean_grad in zip(noisy_grads.gradients[0], clean_grads.gradients[0]):
        if clean_grad is not None:
            torch.testing.assert_close(noisy_grad, clean_grad)


def test_rows_are_the_sampled_ids_with_the_environment_reward_and_episode_metrics(tokenizer, single_thread):
    engine = ScriptedEngine(tokenizer, policy_script())
    rollout = EpisodeRollout(engine, tokenizer, EpisodeOptions("test_tool_sum", batch_window=5.0))
    batch, trajectories, _ = rollout.generate(RECORDS, 3, torch.device("cpu"))
    metrics = Grader("none")(batch)
    metrics.update(rollout.grade(batch, trajectories))
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    sampled = [list(sample.ids) for _, sample in engine.script.samples]
    for row, trajectory in enumerate(trajectories):
        real = batch.attention_mask[row].bool()
        assert batch.input_ids[row][real].tolist() == list(trajectory.token_ids)
        policy = batch.policy_mask[row][real].bool()
        turns = [list(trajectory.token_ids[turn.start:turn.end]) for turn in trajectory.policy_turns()]
        assert len(turns) == 2 and all(turn in sampled for turn in turns)  # each policy turn exactly as sampled
        assert batch.input_ids[row][real][policy].tolist() == turns[0] + turns[1]  # and nothing else is the policy's
        assert (batch.rollout_logprobs[row][real][policy] < 0).all()
        assert not batch.rollout_logprobs[row][real][~policy].any()
    assert (batch.policy_versions[batch.attention_mask.bool()] == 3).all()
    assert batch.outcome_rewards.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert batch.correct.tolist() == [True, True, False, True, True, False]
    assert batch.responses[2] == "\\boxed{6}"
    assert metrics["episodes/success_rate"] == pytest.approx(4 / 6)
    assert metrics["episodes/turns_mean"] == 2.0 and metrics["episodes/tool_calls"] == 6.0
    turns = batch.columns["episode"][0]["turns"]
    assert [turn["role"] for turn in turns] == ["policy", "tool", "policy"]
    assert '"add"' in turns[0]["text"] and "5" in turns[1]["text"]


class ZeroForward:
    """An actor whose forward is zeros (rows of thousands of tokens cost nothing)."""

    device, options, reference, value_head, tap = torch.device("cpu"), LossOptions(), None, None, None

    def forward(self, batch, tap=False, temperature=None):
        return ActorOutput(torch.zeros(batch.response_mask.shape), torch.zeros(batch.response_mask.shape))


def fault_step(tokenizer, records, respond=None, **options):
    """make_experience over episodes of ``test_tool_sum`` with a fake forward."""
    engine = ScriptedEngine(tokenizer, respond or policy_script())
    actor = ZeroForward()
    rollout = EpisodeRollout(engine, tokenizer, EpisodeOptions("test_tool_sum", **options))
    maker = ExperienceMaker(actor, engine, Grader("none"), None, AdvantageOptions(), UpdateOptions(),
                            SamplingControls(mask_truncated=True), 1, episodes=rollout)
    prompts = PromptBatch([r["prompt"] for r in records], [r["answer"] for r in records],
                          {"fault": [r.get("fault") for r in records]})
    return maker.make_experience(prompts, 0)


class FirstTurnNonFinite(ScriptedEngine):
    """Its scores were not finite for the episodes' first turns only (its flag is that of its last call)."""

    calls = 0

    def generate_from_ids(self, prompts, max_new_tokens, temperature=None) -> TokenRollouts:
        self.calls += 1
        self.saw_nonfinite_logits = self.calls == 1
        return super().generate_from_ids(prompts, max_new_tokens, temperature)


def test_a_nonfinite_score_in_any_turn_of_the_episodes_is_the_steps(tokenizer, single_thread):
    engine = FirstTurnNonFinite(tokenizer, policy_script())
    rollout = EpisodeRollout(engine, tokenizer, EpisodeOptions("test_tool_sum", batch_window=5.0))
    maker = ExperienceMaker(ZeroForward(), engine, Grader("none"), None, AdvantageOptions(), UpdateOptions(),
                            SamplingControls(), 2, episodes=rollout)
    with pytest.raises(NonFiniteStep, match="generation logits"):
        maker.make_experience(RECORDS, 0)
    assert engine.calls == 2 and not engine.saw_nonfinite_logits  # the tool call's turn, then the answer's


@pytest.fixture
def release_hung_calls():
    HANG.clear()
    yield
    HANG.set()


def test_faults_through_the_step_are_bounded_and_counted(tokenizer, release_hung_calls, single_thread):
    records = [{"prompt": "What is 2+3?", "answer": "5", "fault": fault}
               for fault in (None, "reset_raises", "step_hangs", "not_a_string")]
    experience = fault_step(tokenizer, records, call_timeout=0.5)
    metrics = experience.metrics
    assert experience.batch_size == 3  # the episode whose reset raised never reached the policy: no row
    assert metrics["episodes/env_errors"] == 2.0 and metrics["episodes/env_timeouts"] == 1.0
    assert metrics["episodes/fault_rate"] == pytest.approx(3 / 4)
    assert [row["stop_reason"] for row in experience.columns["episode"]] == ["done", "env_timeout", "env_error"]


@pytest.mark.parametrize("tool_text, counter", [(call("flood"), "episodes/tool_replies_truncated"),
                                                (call("add", numbers=[1]) * 1000, "episodes/tool_calls_over_limit")],
                         ids=["a 10 MB reply", "1000 calls in a turn"])
def test_a_flood_of_output_or_of_calls_is_cut_and_counted(tokenizer, tool_text, counter, single_thread):
    records = [{"prompt": "What is 2+3?", "answer": "5"}]
    experience = fault_step(tokenizer, records, policy_script(tool_text), max_tokens=100_000,
                            max_tool_reply_chars=200, max_tool_calls=8)
    assert experience.metrics[counter] > 0
    assert experience.metrics["episodes/tool_calls"] <= 8
    replies = [turn["text"] for turn in experience.columns["episode"][0]["turns"] if turn["role"] == "tool"]
    assert replies and len(replies[0]) < 8 * 400  # what the model reads of the replies stays bounded
    assert experience.columns["episode"][0]["stop_reason"] == "done"


def test_an_environment_failing_every_episode_is_one_line_before_any_update(tokenizer, single_thread):
    records = [{"prompt": "What is 2+3?", "answer": "5", "fault": "reset_raises"}] * 2
    with pytest.raises(RunError, match=r"environment 'test_tool_sum' failed in all 2 episodes.*sandbox") as error:
        fault_step(tokenizer, records)
    assert "\n" not in str(error.value)


def test_an_engine_without_a_token_in_path_is_one_line(tokenizer):
    with pytest.raises(ConfigError, match="token-in path"):
        EpisodeRollout(object(), tokenizer, EpisodeOptions("test_tool_sum"))


def test_the_turns_reward_sums_each_turns_reward_with_its_discount(tokenizer):
    engine = ScriptedEngine(tokenizer, policy_script())
    options = EpisodeOptions("test_tool_sum", reward="turns", reward_gamma=0.5, batch_window=5.0)
    rollout = EpisodeRollout(engine, tokenizer, options)
    batch, trajectories, _ = rollout.generate(RECORDS, 3, torch.device("cpu"))
    Grader("none")(batch)
    rollout.grade(batch, trajectories)
    assert [t.turn_rewards for t in trajectories[:3]] == [(0.0, 1.0), (0.0, 1.0), (0.0, 0.0)]  # the tool turn: 0
    assert batch.outcome_rewards.tolist() == [0.5, 0.5, 0.0, 0.5, 0.5, 0.0]


def test_prompts_longer_than_the_episode_budget_are_one_line(tokenizer):
    rollout = EpisodeRollout(ScriptedEngine(tokenizer, policy_script()), tokenizer,
                             EpisodeOptions("test_tool_sum", max_tokens=4))
    with pytest.raises(RunError, match="no episode of environment 'test_tool_sum' reached the policy's first turn "
                                       r"\(episodes.max_tokens 4 below the prompts\?\); the first: max_tokens"):
        rollout.generate(RECORDS, 2, torch.device("cpu"))
