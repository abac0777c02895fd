"""The rollout-engine contract (flowkit.llm.rollout_engine): every registered engine satisfies it, the HF engine's
sampler log-probs are the trainer's, and the step logs the mismatch and applies the configured correction."""

import csv
import inspect
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from flowkit.cli import FlowkitCLI
from flowkit.llm.backbone import load_backbone
from flowkit.step import SamplingOptions
from flowkit.llm.engines import ROLLOUT_ENGINES, RolloutOptions
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.rollout_engine import (
    EngineSetup, EngineSpec, PrefetchingEngine, RolloutEngine, prefetch_ahead, rollout_metrics,
)
from flowkit.llm.server_engine import ServerRolloutEngine
from flowkit.llm.vllm_engine import VllmRolloutEngine
from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.rl.logprobs import lm_head_logprobs
from flowkit.llm.forward import forward_hidden

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["47+38=", "12+13=", "9+9="]


class CountingEngine:
    """A rollout engine added from this file alone: the HF engine, counting its generations and weight syncs."""

    def __init__(self, setup: EngineSetup):
        self.inner = HFRolloutEngine(setup.policy, setup.tokenizer, setup.max_new_tokens, setup.temperature,
                                     setup.top_p)
        self.tokenizer, self.generated, self.synced = setup.tokenizer, 0, []

    @property
    def saw_nonfinite_logits(self) -> bool:
        return self.inner.saw_nonfinite_logits

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def generate(self, prompts, n=1, answers=None, temperature=None):
        self.generated += 1
        return self.inner.generate(prompts, n, answers, temperature=temperature)

    def sync_weights(self, model, version):
        self.synced.append(version)
        self.inner.sync_weights(model, version)

    def close(self):
        self.inner.close()


def test_an_engine_registered_from_one_file_trains_the_policy(tmp_path, monkeypatch):
    built = []
    monkeypatch.setitem(ROLLOUT_ENGINES, "counting", EngineSpec(lambda setup: built.append(CountingEngine(setup))
                                                                or built[-1]))
    module = PolicyModule(rollout=RolloutOptions(engine="counting"),
                          sampling=SamplingOptions(num_samples=2, max_new_tokens=12))
    trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, RolloutDataModule(batch_size=2, val_path=None))
    assert isinstance(built[0], RolloutEngine) and module.rollout_engine is built[0]
    assert trainer.global_step == 2 and built[0].generated == 2
    assert built[0].synced[-2:] == [1, 2]  # told of each optimizer step's weights


def test_every_registered_engine_has_the_contracts_methods():
    model, tokenizer = load_backbone("bundled:tiny_adder")
    assert isinstance(HFRolloutEngine(model, tokenizer, max_new_tokens=4), RolloutEngine)
    for name in ("generate", "sync_weights", "close"):  # vLLM needs vllm, the server a server: compare signatures
        expected = list(inspect.signature(getattr(RolloutEngine, name)).parameters)
        for engine in (VllmRolloutEngine, ServerRolloutEngine):
            assert list(inspect.signature(getattr(engine, name)).parameters) == expected, (engine, name)
    assert set(ROLLOUT_ENGINES) == {"hf", "vllm", "server"}


def test_the_server_engine_is_the_prefetching_one():
    """Checked on the class's methods and on the attributes its constructor sets (an instance needs a server)."""
    assert not isinstance(HFRolloutEngine(*load_backbone("bundled:tiny_adder"), max_new_tokens=4), PrefetchingEngine)
    for name in ("prefetch", "prefetched"):
        expected = list(inspect.signature(getattr(PrefetchingEngine, name)).parameters)
        assert list(inspect.signature(getattr(ServerRolloutEngine, name)).parameters) == expected, name
    constructor = inspect.getsource(ServerRolloutEngine.__init__)
    assert "self.regenerated_rows =" in constructor and "self.max_staleness" in constructor


class PrefetchLog:
    """A prefetching engine that records what it is asked to prefetch; ``take`` is a step's generate taking its own."""

    tokenizer, saw_nonfinite_logits, policy_version, regenerated_rows = None, False, 0, 0

    def __init__(self, max_staleness: int):
        self.max_staleness, self.pending, self.asked = max_staleness, [], []

    def prefetch(self, prompts, n, temperature=None):
        self.pending.append(prompts)
        self.asked.append(prompts[0])

    def prefetched(self, prompts, n, temperature=None):
        return prompts in self.pending

    def take(self, index):
        self.pending.remove([f"batch {index}"])

    def generate(self, prompts, n=1, answers=None, temperature=None):
        raise AssertionError("prefetch_ahead does not generate")

    def sync_weights(self, model, version):
        raise AssertionError("prefetch_ahead does not sync")

    def close(self):
        pass


@pytest.mark.parametrize("k", [1, 2, 3])
def test_prefetch_ahead_keeps_k_batches_in_flight_up_to_the_last_step(k):
    engine, steps = PrefetchLog(k), 6
    assert isinstance(engine, PrefetchingEngine)
    for index in range(2, steps):  # a run resumed at batch 2: its own batch is asked for first
        prefetch_ahead(engine, lambda i: [f"batch {i}"], index, 2, steps_after=steps - 1 - index)
        if index + 1 < steps:
            assert engine.pending == [[f"batch {i}"] for i in range(index, min(index + k, steps - 1) + 1)]
        if engine.prefetched([f"batch {index}"], 2):
            engine.take(index)
    # each batch asked for once, in order, none past the last (batch 5; the last step asks for nothing itself)
    assert engine.asked == [f"batch {i}" for i in range(2, steps)]
    synchronous = PrefetchLog(0)
    prefetch_ahead(synchronous, lambda i: [f"batch {i}"], 0, 2, steps_after=5)
    assert synchronous.asked == []  # k = 0: nothing, not even the step's own batch


def test_rollout_metrics_by_hand():
    """Rows whose oldest tokens are 3, 1, 1, 0, 0 and 0 versions behind version 7 (k = 2): mean 5/6, max 3, and the
    fraction of rows at each staleness from 0 to max(k, 3), padding (version 0 here) not counted; rows 0 and 1 are
    partial (their second response token from a newer version): 2/6 mixed, and per response token (two per row:
    3 and 2, 1 and 0, 1 and 1, then zeros) 8/12 behind; a non-prefetching engine regenerates nothing and logs no
    count."""
    first = torch.tensor([4, 6, 6, 7, 7, 7])
    versions = first[:, None].repeat(1, 4)  # [prompt][response][response][padding]
    versions[0, 2], versions[1, 2], versions[:, 3] = 5, 7, 0
    attention_mask = torch.tensor([[1, 1, 1, 0]] * 6)
    response_mask = torch.tensor([[0.0, 1, 1, 0]] * 6)
    batch = SimpleNamespace(policy_versions=versions, attention_mask=attention_mask, response_mask=response_mask)
    metrics = {name: float(value) for name, value in
               rollout_metrics(SimpleNamespace(policy_version=7), batch, max_staleness=2).items()}
    assert metrics == pytest.approx({"rollout/staleness_mean": 5 / 6, "rollout/staleness_max": 3.0,
                                     "rollout/token_staleness_mean": (3 + 2 + 1 + 0 + 1 + 1) / 12,
                                     "rollout/mixed_rows": 2 / 6,
                                     "rollout/staleness_0": 3 / 6, "rollout/staleness_1": 2 / 6,
                                     "rollout/staleness_2": 0.0, "rollout/staleness_3": 1 / 6})
    engine = PrefetchLog(2)
    engine.policy_version, engine.regenerated_rows = 7, 12
    assert rollout_metrics(engine, batch, max_staleness=2)["rollout/regenerated_rows"] == 12.0
    assert rollout_metrics(engine, SimpleNamespace(policy_versions=None), max_staleness=2) == {}


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (0.0, 1.0)])
def test_hf_sampler_logprobs_equal_the_trainers_forward(single_thread, temperature, top_p):
    torch.manual_seed(0)
    model, tokenizer = load_backbone("bundled:tiny_adder")
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=24, temperature=temperature, top_p=top_p)
    engine.sync_weights(model, 7)
    batch = engine.generate(PROMPTS, n=4)
    assert torch.equal(batch.policy_versions, torch.full((12,), 7))
    with torch.no_grad():
        trainer, _ = lm_head_logprobs(forward_hidden(model, batch), model.get_output_embeddings(), batch.input_ids,
                                      batch.response_mask, temperature or 1.0)
    on = batch.response_mask.bool()
    assert on.sum() > 12  # the responses have tokens
    assert torch.equal(batch.rollout_logprobs[~on], torch.zeros(int((~on).sum())))
    torch.testing.assert_close(batch.rollout_logprobs[on], trainer[on], atol=2e-5, rtol=0)


def test_a_fit_logs_the_rollout_mismatch_and_applies_the_correction(tmp_path, monkeypatch, single_thread):
    monkeypatch.chdir(tmp_path)
    cli = FlowkitCLI(args=["fit", "--config", str(ROOT / "configs" / "rlfr_tiny.yaml"), "--trainer.max_steps", "2",
                           "--trainer.enable_progress_bar", "false", "--model.init_args.flow_pretrain.steps", "0",
                           "--data.init_args.batch_size", "4", "--model.init_args.sampling.max_new_tokens", "24",
                           "--model.init_args.loss.rollout_correction.mode", "icepop",
                           "--model.init_args.loss.rollout_correction.off_policy_mask", "0.1"])
    assert cli.model.loss_options.rollout_correction.mode == "icepop"
    with open(Path(cli.trainer.logger.log_dir) / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("rollout_corr/abs_diff_mean")]
    assert len(rows) == 2
    for row in rows:
        assert float(row["rollout_corr/abs_diff_max"]) < 1e-4  # the same weights in fp32: numerics only
        assert float(row["rollout_corr/weight_mean"]) == pytest.approx(1.0, abs=1e-4)
        assert float(row["rollout_corr/masked_frac"]) == 0.0
        assert float(row["rollout_corr/off_policy_masked_frac"]) == 0.0


@pytest.mark.parametrize("correction", [{"mode": "token_tis", "cap": 2.0}, {"mode": "token_mis", "cap": 2.0},
                                        {"mode": "seq_tis", "cap": 1e9}, {"bypass": True}])
def test_the_actors_loss_applies_the_correction(single_thread, correction):
    """Rows whose engine sampled each token with a quarter of the trainer's probability (ρ = 4): the actor's loss is
    the clipped surrogate with, per token, weight 2 (token TIS at cap 2), 0 (MIS at cap 2: ρ leaves the band),
    min(4^length, e^20) (sequence TIS: ∏ρ, the log bounded at 20), or the rollout's log-probs as PPO's anchor."""
    from flowkit.step import Actor, LossOptions, StepStats, UpdateOptions
    from flowkit.rl.losses import LossContext, aggregation_denominator, clipped_policy_loss
    from flowkit.rl.rollout_correction import RolloutCorrection

    torch.manual_seed(0)
    model, tokenizer = load_backbone("bundled:tiny_adder")
    batch = HFRolloutEngine(model, tokenizer, max_new_tokens=12).generate(PROMPTS, n=2)
    mask = batch.response_mask
    batch.advantages = torch.randn(mask.shape) * mask
    actor = Actor(model, None, None, None, UpdateOptions(), LossOptions(rollout_correction=RolloutCorrection(**correction)))
    out = actor.forward(batch)
    batch.old_logprobs = out.logprobs.detach() + 0.1 * mask  # a PPO ratio ≠ 1, so the anchor matters
    batch.rollout_logprobs = batch.old_logprobs - torch.log(torch.tensor(4.0)) * mask
    denominator = aggregation_denominator(mask)
    stats = StepStats()
    loss = actor.loss(batch, out, denominator, mask.sum(), stats)
    stats.close_minibatch()
    logged = {name.removeprefix("rollout_corr/"): float(value) for name, value in stats.means().items()
              if name.endswith("_frac")}
    assert logged == {"token_tis": {"truncated_frac": 1.0, "masked_frac": 0.0},  # every ρ = 4 is capped at 2
                      "token_mis": {"masked_frac": 1.0, "truncated_frac": 0.0},  # every ρ = 4 leaves [0, 2]
                      "seq_tis": {"truncated_frac": 0.0, "masked_frac": 0.0, "seq_truncated_frac": 0.0},  # ≤ e^20
                      }.get(correction.get("mode"), {})  # bypass: no weights, nothing masked or truncated

    anchor, weights = batch.old_logprobs, None
    if correction.get("mode") == "token_tis":
        weights = 2.0 * mask
    elif correction.get("mode") == "token_mis":
        weights = 0.0 * mask
    elif correction.get("mode") == "seq_tis":
        weights = torch.exp((mask.sum(-1, keepdim=True) * torch.log(torch.tensor(4.0))).clamp(max=20.0)) * mask
    else:
        anchor = batch.rollout_logprobs
    expected, _ = clipped_policy_loss(out.logprobs, anchor, batch.advantages, mask,
                                      LossContext(importance_weights=weights, denominator=denominator))
    torch.testing.assert_close(loss, expected)
    assert not torch.allclose(loss, clipped_policy_loss(out.logprobs, batch.old_logprobs, batch.advantages, mask,
                                                         LossContext(denominator=denominator))[0])  # the correction did something
