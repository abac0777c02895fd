"""Explanation rewards (seed 000, "TPL") on Lightning, around the shared RL engine.

- :class:`ExplanationDataModule`: JSONL rows ``{context, decisions, decision}`` (decision by index or label),
  optionally ``explanation`` (a reference) and ``preferred`` (a preferred explanation, for the SFT start), as the
  prompt batches :class:`~flowkit.modules.PolicyModule` trains on: the explanation prompt x^e (decision withheld) is
  the policy's prompt, and the record's fields reach the reward model as columns.
- :class:`ExplanationRounds`: the paper's round structure (App. F) as a callback — at each round start, the flow
  phase of :class:`~flowkit.rewards.ExplanationReward` (explain → proxies → rejection sampling → flow epochs) and the
  held-out evaluation; between round starts, PPO steps of the policy module.
- :class:`ExplanationRewardModule`: trains the rectified flow φ alone on given explanations (the data's reference
  ``explanation`` field), with proxy scoring and rejection sampling.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from flowkit.errors import ConfigError, check_range
from flowkit.explain.prompts import EXPLANATION_TEMPLATE
from flowkit.explain.proxy import proxy_probabilities, rejection_mask
from flowkit.explain.reward_model import ExplanationFlowModel, explanation_inputs
from flowkit.llm.backbone import load_backbone
from flowkit.llm.chat import PromptFormat, resolve_prompt_format
from flowkit.llm.packing import encode_pairs
from flowkit.modules.datamodule import RolloutDataModule
from flowkit.rewards.explanation import ExplanationReward, load_frozen
from flowkit.step.finite import raise_if_nonfinite


def normalize_record(record: dict[str, Any]) -> dict[str, Any]:
    """``decision`` as an index into ``decisions`` (given as an index or as one of the labels)."""
    decisions = [str(d) for d in record["decisions"]]
    decision = record["decision"]
    if isinstance(decision, int) and not isinstance(decision, bool):
        if not 0 <= decision < len(decisions):
            raise ValueError(f"field 'decision' {decision} is not an index into the {len(decisions)} decisions")
        index = decision
    elif str(decision) in decisions:
        index = decisions.index(str(decision))
    else:
        raise ValueError(f"field 'decision' {decision!r} is none of the decisions {decisions}")
    row = {"context": str(record["context"]), "decisions": decisions, "decision": index}
    for optional in ("explanation", "preferred"):  # a reference explanation; the preferred one for SFT
        if record.get(optional):
            row[optional] = str(record[optional])
    return row


class ExplanationDataModule(RolloutDataModule):
    """Decision records for explanation training; ``bundled:gridworld/...`` is the toy task.

    A record ``{context, decisions, decision[, explanation][, preferred]}`` becomes a prompt row: ``prompt`` the
    explanation prompt x^e of the context ("Given [c]. Please analyze reasoning for the agent decision based on the
    context.", rendered with the policy's chat template under ``prompt_format: auto`` for instruct models),
    ``answer`` the decision's label, ``solution`` the preferred explanation (the SFT start), and the columns
    ``context``, ``decisions``, ``decision`` (an index) and ``explanation`` for the reward model. Batching, seeds,
    resuming and bad-record handling are :class:`~flowkit.modules.RolloutDataModule`'s: ``batch_size`` is the
    global number of contexts per RL step (each of W ranks draws ``batch_size / W``).

    Args:
        train_path, test_path: the training and held-out records (validation and the rounds' evaluation).
        num_train, num_test: the first records of each (null: all).
    """

    def __init__(self, train_path: str = "bundled:gridworld/train.jsonl",
                 test_path: str = "bundled:gridworld/test.jsonl", num_train: int | None = None,
                 num_test: int | None = None, batch_size: int = 12, val_batch_size: int = 32,
                 prompt_format: PromptFormat = "auto", on_error: str = "raise", seed: int | None = None):
        check_range("ExplanationDataModule", "num_train", num_train, 1)
        super().__init__(train_path=train_path, val_path=test_path, prompt_key="context", answer_key="decision",
                         solution_key="preferred", prompt_format=prompt_format, prompt_template=EXPLANATION_TEMPLATE,
                         batch_size=batch_size, val_batch_size=val_batch_size, max_val_examples=num_test,
                         on_error=on_error, seed=seed)
        self.num_train = num_train

    def _record_fields(self, prompt_key: str, answer_key: str, solution_key: str | None) -> tuple[list[str], list[str]]:
        return [prompt_key, "decisions", answer_key], [solution_key, "explanation"]

    def _row(self, record: dict[str, Any], prompt: str, answer_key: str, solution_key: str | None) -> dict[str, Any]:
        row = normalize_record(record)
        out = {"prompt": prompt, "answer": row["decisions"][row["decision"]], "context": row["context"],
               "decisions": row["decisions"], "decision": row["decision"]}
        if "preferred" in row:
            out["solution"] = row["preferred"]
        if "explanation" in row:
            out["explanation"] = row["explanation"]
        return out

    def setup(self, stage: str | None = None) -> None:
        fresh = not self.train_records
        super().setup(stage)
        if fresh and self.train_records and self.num_train is not None:
            self.train_records = self.train_records[: self.num_train]
            if len(self.train_records) < self.batch_size:
                raise ConfigError(f"ExplanationDataModule.num_train {self.num_train} cannot fill one batch of "
                                  f"batch_size {self.batch_size}")
        widths = {len(r["decisions"]) for rows in [self.train_records, *self.val_sets.values()] for r in rows}
        if len(widths) > 1:
            raise ConfigError(f"every record needs the same number of candidate decisions, got {sorted(widths)}")

    @property
    def test_records(self) -> list[dict[str, Any]]:
        return self.val_sets.get("heldout", [])

    def steps_per_epoch(self) -> int:
        """RL steps in one pass over the training contexts (each step takes ``batch_size`` of them, all ranks)."""
        return max(1, len(self.train_records) // self.batch_size)


class ExplanationRounds(L.Callback):
    """The paper's rounds (seed 000 App. F) over a :class:`~flowkit.modules.PolicyModule` whose reward model is an
    :class:`~flowkit.rewards.ExplanationReward`: ``rounds`` rounds of ``policy_epochs_per_round`` passes over the
    training contexts, each pass ``len(train) / data.batch_size`` RL steps. Each round starts with the reward model's
    flow phase (its ``fit_round``: explanations → proxies → rejection sampling → flow epochs) and a held-out
    evaluation (``round/*``); after the last RL step, one more evaluation (``final/*``) and the run stops — so the
    trainer's ``max_steps`` can stay -1 (the flow's optimizer steps also count as Lightning steps).

    ``lr_decay: linear`` lowers the policy's (and value head's) learning rate linearly from ``lr`` to 0 over the run
    (the paper's schedule); ``constant`` leaves it.
    """

    ends_fit = True  # it stops the run: the endless prompt stream needs no max_steps (RolloutDataModule)

    def __init__(self, rounds: int = 2, policy_epochs_per_round: int = 10, lr_decay: str = "linear"):
        check_range("ExplanationRounds", "rounds", rounds, 1)
        check_range("ExplanationRounds", "policy_epochs_per_round", policy_epochs_per_round, 1)
        if lr_decay not in ("linear", "constant"):
            raise ConfigError(f"ExplanationRounds.lr_decay must be linear or constant, got {lr_decay!r}")
        self.rounds, self.policy_epochs_per_round, self.lr_decay = rounds, policy_epochs_per_round, lr_decay
        self.steps_per_round = self.total_steps = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not isinstance(getattr(pl_module, "reward_model", None), ExplanationReward):
            raise ConfigError("ExplanationRounds needs a PolicyModule whose reward_model is an ExplanationReward")
        if not isinstance(trainer.datamodule, ExplanationDataModule):
            raise ConfigError("ExplanationRounds needs an ExplanationDataModule")
        if stage == "fit":
            self.steps_per_round = self.policy_epochs_per_round * trainer.datamodule.steps_per_epoch()
            self.total_steps = self.rounds * self.steps_per_round

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        step = int(batch["index"])  # the RL step (the prompt stream's index survives a resume)
        if self.lr_decay == "linear":
            for group in pl_module.optimizers().param_groups:
                if group["name"] in ("policy", "value"):
                    group["lr"] = pl_module.optim.lr * (1 - step / self.total_steps)
        if step % self.steps_per_round == 0:
            reward: ExplanationReward = pl_module.reward_model
            metrics = reward.fit_round(trainer.datamodule.train_records, self._generate(pl_module),
                                       self._flow_step(pl_module), step // self.steps_per_round, trainer.global_rank,
                                       trainer.world_size)
            pl_module.log_dict(metrics)
            self._evaluate(trainer, pl_module, "round")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if int(batch["index"]) + 1 >= self.total_steps:  # the last RL step of the last round
            self._evaluate(trainer, pl_module, "final")
            trainer.should_stop = True

    @staticmethod
    def _generate(pl_module: L.LightningModule):
        return lambda prompts, n, temperature: pl_module.rollout_engine.generate(prompts, n, None, temperature=temperature)

    @staticmethod
    def _flow_step(pl_module: L.LightningModule):
        def step(loss: Tensor) -> None:
            optimizer = pl_module.step_optimizer()
            optimizer.backward(loss)
            raise_if_nonfinite(optimizer.nonfinite({"reward"}))
            optimizer.step({"reward"})
        return step

    def _evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule, prefix: str) -> None:
        """The reward model's evaluation over this rank's share of the held-out contexts, averaged over all ranks."""
        reward: ExplanationReward = pl_module.reward_model
        rows = reward.heldout(trainer.datamodule.test_records, trainer.global_rank, trainer.world_size)
        size = trainer.datamodule.val_batch_size
        totals: dict[str, list[float]] = {}
        for start in range(0, len(rows), size):
            chunk = rows[start:start + size]
            batch = {key: [r[key] for r in chunk] for key in chunk[0]}
            for name, (value, weight) in reward.evaluate(batch, self._generate(pl_module)).items():
                total = totals.setdefault(name, [0.0, 0.0])
                total[0] += value * weight
                total[1] += weight
        names = sorted(totals)  # every rank evaluates the same metrics (agreed shares, the same reward mode)
        sums = torch.tensor([totals[n] for n in names], dtype=torch.float64, device=pl_module.device).reshape(-1, 2)
        sums = trainer.strategy.reduce(sums, reduce_op="sum")
        pl_module.log_dict({f"{prefix}/{name}": value / weight for name, (value, weight) in zip(names, sums.tolist())
                            if weight})


class ExplanationRewardModule(L.LightningModule):
    """Trains φ on explanations from the data (``explanation`` field) against proxy logits (Eq. 3).

    Rejection sampling keeps, per proxy, the rows whose argmax is the true decision; each kept
    (row, proxy) pair is one flow target z1 = softmax(M_k). Validation reports the flow's accuracy on
    held-out positive and negative rows (rows the first proxy gets right / wrong). ``encode_batch_size``
    rows go through the frozen backbone per pass (only its last layer's K/V are kept); ``prompt_format`` as in
    :class:`~flowkit.rewards.ExplanationReward`.
    """

    def __init__(self, backbone: str = "bundled:explain_tiny/policy",
                 proxies: list[str] | None = None, dtype: str = "float32", trust_remote_code: bool = False,
                 num_decisions: int = 4, sigma: float = 1.0, ode_steps: int = 8, num_draws: int = 16,
                 time_dim: int = 64, projector_dim: int = 256, flow_attention: bool = True, lr: float = 2e-4,
                 encode_batch_size: int = 8, prompt_format: PromptFormat = "auto"):
        super().__init__()
        owner = "ExplanationRewardModule"
        check_range(owner, "num_decisions", num_decisions, 2)
        check_range(owner, "sigma", sigma, 0, open_low=True)
        for name, value in [("ode_steps", ode_steps), ("num_draws", num_draws), ("time_dim", time_dim),
                            ("projector_dim", projector_dim), ("encode_batch_size", encode_batch_size)]:
            check_range(owner, name, value, 1)
        check_range(owner, "lr", lr, 0, open_low=True)
        if proxies is not None and not proxies:
            raise ConfigError(f"{owner}.proxies must not be empty")
        self.save_hyperparameters()
        proxies = proxies or [f"bundled:explain_tiny/proxy{i}" for i in range(3)]
        self.backbone, self.tokenizer = load_backbone(backbone, dtype, trust_remote_code)
        self.backbone.requires_grad_(False).eval()
        self.proxies, self.proxy_tokenizers = load_frozen(proxies, dtype, trust_remote_code)
        self.proxy_formats = [resolve_prompt_format(prompt_format, t) for t in self.proxy_tokenizers]
        self.reward_model = ExplanationFlowModel(num_decisions, self.backbone.config.hidden_size, sigma, ode_steps,
                                                 num_draws, time_dim, projector_dim, flow_attention, encode_batch_size)
        self.accuracy = torch.nn.ModuleDict({kind: MulticlassAccuracy(num_decisions, average="micro")
                                             for kind in ("positive", "negative")})

    def _encode(self, rows: dict[str, list]):
        explanations = rows["explanation"]
        batch = encode_pairs(self.tokenizer, rows["prompt"], explanations).to(self.device)
        inputs = explanation_inputs(batch, self.tokenizer)
        probs = proxy_probabilities(list(zip(self.proxies, self.proxy_tokenizers)), rows["context"], explanations,
                                    rows["decisions"], prompt_formats=self.proxy_formats)
        return self.reward_model.encode(self.backbone, inputs.input_ids, inputs.attention_mask), probs

    def training_step(self, rows: dict[str, list], batch_idx: int) -> Tensor | None:
        if "explanation" not in rows:
            raise ConfigError("ExplanationRewardModule trains on the records' reference `explanation` field")
        context, probs = self._encode(rows)
        decisions = torch.tensor(rows["decision"], device=self.device)
        kept = rejection_mask(probs, decisions)  # [K_p, B]
        proxy_index, row_index = kept.nonzero(as_tuple=True)
        self.log("train/acceptance", kept.float().mean(), batch_size=len(decisions))
        if len(row_index) == 0:
            return None
        loss = self.reward_model.loss(context.select(row_index), probs[proxy_index, row_index])
        self.log("train/flow_loss", loss, prog_bar=True, batch_size=len(row_index))
        return loss

    def validation_step(self, rows: dict[str, list], batch_idx: int) -> None:
        context, probs = self._encode(rows)
        decisions = torch.tensor(rows["decision"], device=self.device)
        predicted = self.reward_model.predict(context).argmax(-1)
        positive = rejection_mask(probs[0], decisions)
        for kind, rows_of_kind in (("positive", positive), ("negative", ~positive)):
            if rows_of_kind.any():
                self.accuracy[kind].update(predicted[rows_of_kind], decisions[rows_of_kind])

    def on_validation_epoch_end(self) -> None:
        for kind, metric in self.accuracy.items():
            if metric.update_count:
                self.log(f"val/flow_accuracy_{kind}", metric.compute())
            metric.reset()

    def configure_optimizers(self):
        return torch.optim.Adam(self.reward_model.parameters(), lr=self.hparams.lr)

