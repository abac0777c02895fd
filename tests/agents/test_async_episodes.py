"""Agent episodes ahead of training on the ``server`` engine (``rollout.max_staleness: 1``) against a real
``flowkit rollout-server`` process on 127.0.0.1 serving the bundled ``tiny_tool_adder``: the next step's episodes run
while this one trains, one version behind, and the step still trains on exactly the ids the server sampled, each
policy token within the staleness bound and the loss on the policy's tokens alone — with ``partial_rollouts`` too
(a push lands mid-turn). Colocated engines refuse ``max_staleness`` for episodes in one line.

The ``vllm`` backend's variant runs in the vLLM venv (``-m vllm``, .ci/run) and skips without vLLM.
"""

from __future__ import annotations

import csv
import sys
import threading
from collections import defaultdict
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger

from flowkit.agents import EpisodeOptions
from flowkit.errors import ConfigError
from flowkit.llm.engines import RolloutOptions
from flowkit.modules import PolicyModule, RolloutDataModule
from flowkit.step import SamplingOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout_server_process import BACKENDS, RolloutServer  # noqa: E402

TIMEOUT_S = 30.0


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, tmp_path_factory):
    # one trainer run after another: each takes the weight channel once the previous one is silent (--lease)
    running = RolloutServer(tmp_path_factory.mktemp("server") / "server.log", TIMEOUT_S, request.param,
                            extra=("--lease", "0.01"), backbone="bundled:tiny_tool_adder")
    yield running
    running.kill()


class Trained(Callback):
    """Each step's experience, and every turn the server engine sampled (ids, log-probs, versions) by the token ids
    it was asked to continue (a group's episodes start from the same ids). Each step's weights are pushed only once
    a turn past those it trained came back (the next step's episodes, running meanwhile): their first turns are
    sampled from the weights this step trained, whatever the load (the trainer may well push before the next
    episodes' first request reaches the server)."""

    def __init__(self):
        self.experiences, self.sampled = [], defaultdict(list)
        self.turns = threading.Condition()
        self.sampled_turns = self.trained_turns = 0

    def on_fit_start(self, trainer, module):
        engine = module.rollout_engine
        generate_from_ids = engine.generate_from_ids

        def recorded(prompts, max_new_tokens, temperature=None):
            rollouts = generate_from_ids(prompts, max_new_tokens, temperature)
            with self.turns:
                for prompt, *row in zip(prompts, *rollouts, strict=True):
                    self.sampled[tuple(prompt)].append(tuple(row))
                self.sampled_turns += len(prompts)
                self.turns.notify_all()
            return rollouts

        engine.generate_from_ids = recorded

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):  # before the module's: its push
        experience = outputs["rollouts"]
        self.experiences.append(experience)
        self.trained_turns += sum(len(policy_spans(mask)) for mask in experience.loss_mask.tolist())
        if batch_idx + 1 < trainer.max_steps:
            with self.turns:
                assert self.turns.wait_for(lambda: self.sampled_turns > self.trained_turns, timeout=TIMEOUT_S), \
                    f"step {batch_idx}: no turn of the next step's episodes sampled while it trained"


def policy_spans(mask: list[float]) -> list[tuple[int, int]]:
    """The runs of 1 in a row's loss mask: one per policy turn (the environment's tokens lie between them)."""
    spans, start = [], None
    for position, value in enumerate([*mask, 0.0]):
        if value and start is None:
            start = position
        elif not value and start is not None:
            spans.append((start, position))
            start = None
    return spans


def fit(server: RolloutServer, tmp_path: Path, steps: int, **rollout) -> tuple[dict[int, dict[str, float]], Trained]:
    """``steps`` GRPO steps over long-addition episodes (2 prompts × 2 episodes, up to 3 turns) on the server engine
    with ``max_staleness: 1`` and ``rollout``'s other options; each step's metrics by 0-based step (step k trains
    policy version k), and what it trained on and sampled."""
    L.seed_everything(0)
    module = PolicyModule(
        backbone="bundled:tiny_tool_adder", outcome_reward="none",
        sampling=SamplingOptions(num_samples=2, max_new_tokens=64),
        rollout=RolloutOptions(engine="server", server_url=server.url, server_timeout=TIMEOUT_S, max_staleness=1,
                               **rollout),
        episodes=EpisodeOptions("long_addition", max_turns=3, max_tokens=320))
    data = RolloutDataModule(train_path="bundled:long_addition/k3/train.jsonl", val_path=None, prompt_format="text",
                             batch_size=2)
    trained = Trained()
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, num_sanity_val_steps=0, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1, logger=CSVLogger(tmp_path, name=""),
                        callbacks=[trained])
    trainer.fit(module, datamodule=data)
    metrics = {int(row["step"]): {key: float(value) for key, value in row.items() if value}
               for row in csv.DictReader(open(tmp_path / "version_0" / "metrics.csv"))
               if row.get("rollout/staleness_max")}
    assert sorted(metrics) == list(range(steps))
    return metrics, trained


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
def test_episodes_run_one_step_ahead_on_the_server_and_train_on_the_ids_it_sampled(server, partial, tmp_path,
                                                                                   single_thread):
    """Without ``partial_rollouts`` a push waits for the turn in flight, so every turn comes from one version (a
    row's later turns may come from the next); with it, a turn's tokens may come from two."""
    steps, trained = fit(server, tmp_path, 3, partial_rollouts=partial)
    assert steps[0]["rollout/staleness_max"] == 0.0  # nothing ran before the first step: its own first
    for step in (1, 2):  # run while the step before trained: their first turns from the weights one version back
        assert steps[step]["rollout/staleness_max"] == 1.0, step
    assert steps[2]["rollout/regenerated_rows"] == 0.0
    assert max(values["episodes/turns_mean"] for values in steps.values()) > 1.0  # tool calls, then the answer

    for version, experience in enumerate(trained.experiences):
        for row in range(experience.batch_size):
            ids = experience.input_ids[row].tolist()
            first = int(experience.attention_mask[row].nonzero()[0])
            for start, end in policy_spans(experience.loss_mask[row].tolist()):
                asked = trained.sampled[tuple(ids[first:start])]
                # the ids trained on are ids the server sampled for this prompt, with their log-probs and versions
                assert ids[start:end] in [sampled_ids for sampled_ids, _, _ in asked]
                turn = next(turn for turn in asked if turn[0] == ids[start:end])
                asked.remove(turn)
                _, logprobs, versions = turn
                assert experience.rollout_logprobs[row, start:end].tolist() == pytest.approx(logprobs)
                assert experience.policy_versions[row, start:end].tolist() == versions
                assert all(0 <= version - sampled <= 1 for sampled in versions), (version, versions)
                assert partial or len(set(versions)) == 1, versions
    assert not any(trained.sampled.values())  # every sampled turn is trained on, and nothing else is in the loss


@pytest.mark.parametrize("server", ["hf"], indirect=True)
def test_episodes_more_than_max_staleness_behind_run_again(server, tmp_path, single_thread):
    """Weights pushed every 2 steps (``server_sync_every 2``): episodes run while the server still held version v
    train at v + 2, too stale, so they run again from the newest weights pushed, as single-turn rows are
    regenerated; the rows trained are never more than 1 version behind."""
    steps, trained = fit(server, tmp_path, 4, server_sync_every=2)
    assert all(values["rollout/staleness_max"] <= 1.0 for values in steps.values())
    assert steps[3]["rollout/regenerated_rows"] > 0
    for version, experience in enumerate(trained.experiences):
        sampled = experience.policy_versions[experience.loss_mask.bool()]
        assert bool(((version - sampled >= 0) & (version - sampled <= 1)).all()), (version, sampled.unique())


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_colocated_engines_refuse_episodes_ahead_of_training_before_the_model_loads(engine):
    with pytest.raises(ConfigError, match=rf"^PolicyModule.rollout.max_staleness 1 runs episodes ahead of training "
                                          rf"on rollout.engine server only, not '{engine}'"):
        PolicyModule(backbone="bundled:tiny_tool_adder", outcome_reward="none",
                     rollout=RolloutOptions(engine=engine, max_staleness=1),
                     episodes=EpisodeOptions("long_addition"))
