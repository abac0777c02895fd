"""Explanation rewards (seed 000, "TPL") on Lightning.

- :class:`ExplanationDataModule`: JSONL rows ``{context, decisions, decision}`` (decision by index or label).
- :class:`ExplanationRewardModule`: trains the rectified flow φ alone on given explanations (e.g. the
  data's reference ``explanation`` field), with proxy scoring and rejection sampling.
- :class:`ExplanationPolicyModule`: the paper's rounds (App. F): the explanation LLM writes explanations
  (decision hidden) → K proxies score every candidate → rejection sampling → flow training → PPO with LoRA
  on the flow's sentence rewards. One round spans ``policy_epochs_per_round`` trainer epochs.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from torch.utils.data import DataLoader
from torchmetrics.classification import MulticlassAccuracy

from flowkit.batch import RolloutBatch
from flowkit.data.records import load_records
from flowkit.distributed import all_reduce_int
from flowkit.explain.context import encode_context
from flowkit.explain.prompts import explanation_prompt
from flowkit.explain.proxy import proxy_probabilities, rejection_mask
from flowkit.explain.reward_model import (
    ExplanationInputs,
    FlowRewardModel,
    explanation_inputs,
    place_token_rewards,
)
from flowkit.explain.sentence_rewards import sentence_rewards_from_probs
from flowkit.llm.backbone import load_backbone
from flowkit.llm.lora import LoraSettings, apply_lora
from flowkit.llm.rollout import RolloutEngine, encode_pairs, forward_logits
from flowkit.modules.datamodule import resolve_data_path
from flowkit.modules.optim import step_groups
from flowkit.rl.advantages import reward_to_go
from flowkit.rl.logprobs import token_logprobs
from flowkit.rl.losses import clipped_policy_loss

RewardMode = Literal["flow", "sparse", "proxy"]


def normalize_record(record: dict[str, Any]) -> dict[str, Any]:
    """``decision`` as an index into ``decisions`` (given as an index or as one of the labels)."""
    decisions = [str(d) for d in record["decisions"]]
    decision = record["decision"]
    index = decision if isinstance(decision, int) else decisions.index(str(decision))
    row = {"context": str(record["context"]), "decisions": decisions, "decision": index}
    if record.get("explanation"):
        row["explanation"] = str(record["explanation"])
    return row


def _rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return rows


class ExplanationDataModule(L.LightningDataModule):
    """Decision records for explanation training; ``bundled:gridworld/...`` is the toy task."""

    def __init__(self, train_path: str = "bundled:gridworld/train.jsonl",
                 test_path: str = "bundled:gridworld/test.jsonl",
                 num_train: int | None = None, num_test: int | None = None, batch_size: int = 12, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.train_records: list[dict[str, Any]] = []
        self.test_records: list[dict[str, Any]] = []

    def setup(self, stage: str) -> None:
        hp = self.hparams
        required = ("context", "decisions", "decision")
        train = [normalize_record(r) for r in load_records(resolve_data_path(hp.train_path), required)]
        test = [normalize_record(r) for r in load_records(resolve_data_path(hp.test_path), required)]
        widths = {len(r["decisions"]) for r in train + test}
        if len(widths) != 1:
            raise ValueError(f"every record needs the same number of candidate decisions, got {sorted(widths)}")
        self.train_records, self.test_records = train[: hp.num_train], test[: hp.num_test]

    @property
    def num_decisions(self) -> int:
        return len(self.train_records[0]["decisions"])

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return DataLoader(self.train_records, batch_size=self.hparams.batch_size, shuffle=True, collate_fn=_rows,
                          generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.test_records, batch_size=self.hparams.batch_size, collate_fn=_rows)


def load_proxies(paths: list[str], dtype: str, trust_remote_code: bool) -> tuple[torch.nn.ModuleList, list]:
    models, tokenizers = torch.nn.ModuleList(), []
    for path in paths:
        model, tokenizer = load_backbone(path, dtype, trust_remote_code)
        models.append(model.requires_grad_(False).eval())
        tokenizers.append(tokenizer)
    return models, tokenizers


def decision_tensor(rows: list[dict[str, Any]], device: torch.device, repeat: int = 1) -> Tensor:
    return torch.tensor([r["decision"] for r in rows], device=device).repeat_interleave(repeat)


class ExplanationRewardModule(L.LightningModule):
    """Trains φ on explanations from the data (``explanation`` field) against proxy logits (Eq. 3).

    Rejection sampling keeps, per proxy, the rows whose argmax is the true decision; each kept
    (row, proxy) pair is one flow target z1 = softmax(M_k). Validation reports the flow's accuracy on
    held-out positive and negative rows (rows the first proxy gets right / wrong).
    """

    def __init__(self, backbone: str = "bundled:explain_tiny/policy",
                 proxies: list[str] | None = None, dtype: str = "float32", trust_remote_code: bool = False,
                 num_decisions: int = 4, sigma: float = 1.0, ode_steps: int = 8, num_draws: int = 16,
                 time_dim: int = 64, projector_dim: int = 256, flow_attention: bool = True, lr: float = 2e-4):
        super().__init__()
        self.save_hyperparameters()
        proxies = proxies or [f"bundled:explain_tiny/proxy{i}" for i in range(3)]
        self.backbone, self.tokenizer = load_backbone(backbone, dtype, trust_remote_code)
        self.backbone.requires_grad_(False).eval()
        self.proxies, self.proxy_tokenizers = load_proxies(proxies, dtype, trust_remote_code)
        self.reward_model = FlowRewardModel(num_decisions, self.backbone.config.hidden_size, sigma, ode_steps,
                                            num_draws, time_dim, projector_dim, flow_attention)
        self.accuracy = torch.nn.ModuleDict({kind: MulticlassAccuracy(num_decisions, average="micro")
                                             for kind in ("positive", "negative")})

    def _encode(self, rows: list[dict[str, Any]]):
        batch = encode_pairs(self.tokenizer, [explanation_prompt(r["context"]) for r in rows],
                             [r["explanation"] for r in rows]).to(self.device)
        inputs = explanation_inputs(batch, self.tokenizer)
        probs = proxy_probabilities(list(zip(self.proxies, self.proxy_tokenizers)), [r["context"] for r in rows],
                                    [r["explanation"] for r in rows], [r["decisions"] for r in rows])
        return encode_context(self.backbone, inputs.input_ids, inputs.attention_mask), probs

    def training_step(self, rows: list[dict[str, Any]], batch_idx: int) -> Tensor:
        context, probs = self._encode(rows)
        decisions = decision_tensor(rows, self.device)
        kept = rejection_mask(probs, decisions)  # [K_p, B]
        proxy_index, row_index = kept.nonzero(as_tuple=True)
        self.log("train/acceptance", kept.float().mean(), batch_size=len(rows))
        if len(row_index) == 0:
            return None
        loss = self.reward_model.loss(context.select(row_index), probs[proxy_index, row_index])
        self.log("train/flow_loss", loss, prog_bar=True, batch_size=len(row_index))
        return loss

    def validation_step(self, rows: list[dict[str, Any]], batch_idx: int) -> None:
        context, probs = self._encode(rows)
        decisions = decision_tensor(rows, self.device)
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


class ExplanationPolicyModule(L.LightningModule):
    """Round-based training of the explanation LLM with flow rewards (seed 000 §3.2, App. C, App. F).

    Args:
        policy: the explanation LLM (hub id, local dir or ``bundled:NAME``); it is also the frozen flow
            backbone (adapters disabled), so ``lora`` is expected; without it a frozen copy is loaded.
        proxies: the K_p proxy LLMs that judge explanations (paper: 3).
        reward: ``flow`` (sentence rewards + sparse), ``sparse`` (only the final 1 for a correct flow
            prediction) or ``proxy`` (sentence rewards from the proxies' own probabilities, no flow).
        flow_attention: False is the attention-free ablation (MLP on pooled last-layer latents).
        explanations_per_context: explanations written per training context each round for flow data.
        round_contexts / heldout_contexts: how many train / test contexts a round's flow phase uses.
        flow_epochs_per_round, flow_batch_size, flow_lr: flow training per round (paper: 100, 128, 2e-4).
        policy_epochs_per_round: trainer epochs of PPO per round (paper: 10); ``trainer.max_epochs`` =
            rounds × this.
        num_samples: explanations per context in a PPO batch; lr decays linearly to 0 over training.
        max_grad_norm: clipping of the PPO steps. Under DeepSpeed it is not applied (Lightning leaves clipping
            to DeepSpeed, whose ``gradient_clipping`` would clip the flow's steps too); a warning says so.
    """

    def __init__(
        self,
        policy: str = "bundled:explain_tiny/policy",
        proxies: list[str] | None = None,
        dtype: str = "float32",
        trust_remote_code: bool = False,
        lora: LoraSettings | None = None,
        reward: RewardMode = "flow",
        flow_attention: bool = True,
        sparse_reward: float = 1.0,
        sigma: float = 1.0,
        ode_steps: int = 8,
        num_draws: int = 16,
        flow_time_dim: int = 64,
        flow_projector_dim: int = 256,
        explanations_per_context: int = 3,
        round_contexts: int | None = None,
        heldout_contexts: int | None = None,
        flow_epochs_per_round: int = 100,
        flow_batch_size: int = 128,
        policy_epochs_per_round: int = 10,
        num_samples: int = 1,
        max_new_tokens: int = 200,
        temperature: float = 1.0,
        eval_temperature: float = 0.7,
        generation_batch_size: int = 64,
        ppo_epochs: int = 1,
        clip: float = 0.2,
        lr: float = 2e-5,
        flow_lr: float = 2e-4,
        max_grad_norm: float | None = 1.0,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.policy, self.tokenizer = load_backbone(policy, dtype, trust_remote_code)
        if lora is not None:
            self.policy = apply_lora(self.policy, lora)
            self.flow_backbone = None  # encode_context disables the adapters: the frozen base reads
        else:
            self.flow_backbone, _ = load_backbone(policy, dtype, trust_remote_code)
            self.flow_backbone.requires_grad_(False).eval()
        proxies = proxies or [f"bundled:explain_tiny/proxy{i}" for i in range(3)]
        self.proxies, self.proxy_tokenizers = load_proxies(proxies, dtype, trust_remote_code)
        self.engine = RolloutEngine(self.policy, self.tokenizer, max_new_tokens, temperature)
        self.reward_model: FlowRewardModel | None = None  # built in setup(), once |A| is known
        self.accuracy = torch.nn.ModuleDict()
        self.generator = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------------------------------------- set-up
    def setup(self, stage: str) -> None:
        if isinstance(self.trainer.strategy, DeepSpeedStrategy) and self.hparams.max_grad_norm is not None:
            rank_zero_warn("max_grad_norm is not applied under DeepSpeed; set gradient_clipping in the DeepSpeed "
                           "config to clip (it then clips the flow's steps as well)")
        if self.reward_model is None:
            num_decisions = self.trainer.datamodule.num_decisions
            hp = self.hparams
            self.reward_model = FlowRewardModel(num_decisions, self.policy.config.hidden_size, hp.sigma,
                                                hp.ode_steps, hp.num_draws, hp.flow_time_dim, hp.flow_projector_dim,
                                                hp.flow_attention)
            self.accuracy = torch.nn.ModuleDict({kind: MulticlassAccuracy(num_decisions, average="micro")
                                                 for kind in ("positive", "negative")})

    def configure_optimizers(self):
        """One Adam, two groups: LoRA (lr, linear decay to 0) and φ (flow_lr, fixed) — App. F."""
        hp = self.hparams
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": hp.lr, "name": "policy"},
                  {"params": list(self.reward_model.parameters()), "lr": hp.flow_lr, "name": "flow"}]
        optimizer = torch.optim.Adam(groups)
        total = max(1, int(self.trainer.estimated_stepping_batches) * hp.ppo_epochs)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: max(0.0, 1 - s / total), lambda s: 1.0])
        return [optimizer], [schedule]

    @property
    def _flow_backbone(self):
        return self.flow_backbone if self.flow_backbone is not None else self.policy

    @property
    def _proxy_pairs(self) -> list:
        return list(zip(self.proxies, self.proxy_tokenizers))

    # --------------------------------------------------------------------------------------- generation
    def _explain(self, rows: list[dict[str, Any]], n: int, temperature: float) -> RolloutBatch:
        prompts = [explanation_prompt(r["context"]) for r in rows]
        size = self.hparams.generation_batch_size
        return RolloutBatch.cat([self.engine.generate(prompts[i:i + size], n=n, temperature=temperature)
                                 for i in range(0, len(prompts), size)])

    def _proxy_probs(self, rows: list[dict[str, Any]], responses: list[str], n: int) -> Tensor:
        """[K_p, B·n, |A|] proxy probabilities for ``responses`` (n per row, grouped)."""
        repeated = [r for r in rows for _ in range(n)]
        return proxy_probabilities(self._proxy_pairs, [r["context"] for r in repeated], responses,
                                   [r["decisions"] for r in repeated])

    # ------------------------------------------------------------------------------------ round: flow
    def on_train_epoch_start(self) -> None:
        hp = self.hparams
        if self.current_epoch % hp.policy_epochs_per_round:
            return
        datamodule = self.trainer.datamodule
        rows = datamodule.train_records[: hp.round_contexts]
        heldout = datamodule.test_records[: hp.heldout_contexts]
        with torch.no_grad():
            batch = self._explain(rows, hp.explanations_per_context, hp.temperature)
            probs = self._proxy_probs(rows, batch.responses, hp.explanations_per_context)
            decisions = decision_tensor(rows, self.device, hp.explanations_per_context)
            kept = rejection_mask(probs, decisions)
        self.log("round/acceptance", kept.float().mean())
        self.log("round/index", float(self.current_epoch // hp.policy_epochs_per_round))
        if hp.reward != "proxy":
            self.log("round/flow_loss", self._train_flow(batch, probs, kept))
        self._evaluate_heldout(heldout)

    def _train_flow(self, batch: RolloutBatch, probs: Tensor, kept: Tensor) -> Tensor:
        """Eq. 3 on the accepted (explanation, proxy) pairs for ``flow_epochs_per_round`` epochs; NaN when
        this rank accepted none."""
        hp = self.hparams
        inputs = explanation_inputs(batch, self.tokenizer)
        context = encode_context(self._flow_backbone, inputs.input_ids, inputs.attention_mask)
        proxy_index, row_index = kept.nonzero(as_tuple=True)
        accepted = len(row_index)
        # Under ZeRO-3 every flow forward, backward and step is a collective: all ranks take the steps of the
        # rank that accepted the most pairs, the others cycling through their own pairs to fill them.
        most_accepted = all_reduce_int(accepted, ReduceOp.MAX)
        if most_accepted == 0:
            return torch.tensor(float("nan"))
        weight = 1.0 if accepted else 0.0
        if not accepted:  # this rank still joins every step, with one pair whose loss counts zero
            proxy_index = row_index = torch.zeros(1, dtype=torch.long, device=kept.device)
        optimizer = self.optimizers()
        losses = []
        for _ in range(hp.flow_epochs_per_round):
            order = self._cycled_order(len(row_index), most_accepted).to(row_index.device)
            for chunk in order.split(hp.flow_batch_size):
                rows, proxies = row_index[chunk], proxy_index[chunk]
                loss = self.reward_model.loss(context.select(rows), probs[proxies, rows], self.generator)
                self.manual_backward(weight * loss)
                step_groups(optimizer, {"flow"})
                optimizer.zero_grad()
                losses.append(loss.detach())
        return torch.stack(losses[-max(1, len(losses) // 10):]).mean() if accepted else torch.tensor(float("nan"))

    def _cycled_order(self, count: int, length: int) -> Tensor:
        """``length`` indices into ``count`` items: shuffled passes over all of them, the last one cut short."""
        passes = [torch.randperm(count, generator=self.generator) for _ in range(math.ceil(length / count))]
        return torch.cat(passes)[:length]

    def _evaluate_heldout(self, rows: list[dict[str, Any]]) -> None:
        """Flow accuracy on held-out positives/negatives (first proxy right/wrong) and explanation accuracy
        (mean over proxies of argmax = true decision) on explanations for unseen contexts."""
        if not rows:
            return
        with torch.no_grad():
            batch = self._explain(rows, 1, self.hparams.eval_temperature)
            probs = self._proxy_probs(rows, batch.responses, 1)
            decisions = decision_tensor(rows, self.device)
            self.log("round/explanation_accuracy", (probs.argmax(-1) == decisions).float().mean())
            if self.hparams.reward == "proxy":
                return
            inputs = explanation_inputs(batch, self.tokenizer)
            context = encode_context(self._flow_backbone, inputs.input_ids, inputs.attention_mask)
            predicted = self.reward_model.predict(context, self.generator).argmax(-1)
        positive = rejection_mask(probs[0], decisions)
        for kind, mask in (("positive", positive), ("negative", ~positive)):
            metric = self.accuracy[kind]
            if mask.any():
                metric.update(predicted[mask], decisions[mask])
            # compute() gathers every rank's state (a collective), so whether to call it is decided on the
            # count over all ranks, and a rank without rows of this kind still joins.
            heldout = all_reduce_int(int(mask.sum()), ReduceOp.SUM)
            if heldout:
                self.log(f"round/flow_accuracy_{kind}", metric.compute())
                self.log(f"round/heldout_{kind}s", float(heldout))
            metric.reset()

    # -------------------------------------------------------------------------------------- PPO step
    def training_step(self, rows: list[dict[str, Any]], batch_idx: int) -> None:
        hp = self.hparams
        n = hp.num_samples
        with torch.no_grad():
            batch = self._explain(rows, n, hp.temperature)
            decisions = decision_tensor(rows, self.device, n)
            inputs = explanation_inputs(batch, self.tokenizer)
            rewards, sparse, stats = self._rewards(rows, batch, inputs, decisions)
            batch.token_rewards = place_token_rewards(tuple(batch.input_ids.shape), inputs, rewards, sparse)
            batch.correct = sparse > 0
            batch.advantages = whitened(reward_to_go(batch.token_rewards, batch.response_mask), batch.response_mask)
            batch.old_logprobs = token_logprobs(forward_logits(self.policy, batch), batch.input_ids)
        metrics = self._ppo(batch)
        metrics.update(stats)
        metrics["train/return"] = batch.token_rewards.sum(-1).mean()
        metrics["train/response_length"] = batch.response_lengths.float().mean()
        self.log_dict(metrics, prog_bar=False, batch_size=batch.batch_size)

    def _rewards(self, rows, batch: RolloutBatch, inputs: ExplanationInputs, decisions: Tensor):
        """(sentence rewards [B, K_max], sparse reward [B], logged stats) for the configured reward mode."""
        hp = self.hparams
        proxy_full = self._proxy_probs(rows, batch.responses, hp.num_samples)
        stats = {"train/explanation_accuracy": (proxy_full.argmax(-1) == decisions).float().mean()}
        if hp.reward == "proxy":
            probs, mask = self._proxy_prefix_probs(rows, batch, inputs, decisions)
            rewards, _ = sentence_rewards_from_probs(probs, mask)
            last = mask.sum(-1) - 1
            full = probs[torch.arange(len(last)), last]
            stats.update({"train/reward_mean": full.mean(), "train/reward_std": full.std()})
            correct = proxy_full.mean(0).argmax(-1) == decisions
            return rewards, correct.float() * hp.sparse_reward, stats
        out = self.reward_model.sentence_rewards(self._flow_backbone, inputs, decisions, self.generator)
        stats.update({"train/reward_mean": out.true_logit_mean.mean(), "train/reward_std": out.true_logit_std.mean(),
                      "train/flow_prediction_accuracy": (out.predicted == decisions).float().mean()})
        rewards = out.rewards if hp.reward == "flow" else torch.zeros_like(out.rewards)
        return rewards, (out.predicted == decisions).float() * hp.sparse_reward, stats

    def _proxy_prefix_probs(self, rows, batch: RolloutBatch, inputs: ExplanationInputs, decisions: Tensor):
        """Proxy-LLM baseline: mean over proxies of p(a* | x^g(k)) for k = 0..K (App. C, Eq. 5)."""
        n = self.hparams.num_samples
        contexts, reasonings, owners = [], [], []
        for b, ends in enumerate(inputs.sentence_ends):
            prompt = int(inputs.prompt_lengths[b])
            ids = inputs.input_ids[b]
            for end in [0, *ends]:
                contexts.append(rows[b // n]["context"])
                reasonings.append(self.tokenizer.decode(ids[prompt:prompt + end], skip_special_tokens=True))
                owners.append(b)
        decision_lists = [rows[b // n]["decisions"] for b in owners]
        # The proxies' forwards are collectives under ZeRO-3 and their number grows with the prefix count: every
        # rank scores as many prefixes as the rank with the most, repeating its last one.
        padding = all_reduce_int(len(owners), ReduceOp.MAX) - len(owners)
        probs = proxy_probabilities(self._proxy_pairs, contexts + contexts[-1:] * padding,
                                    reasonings + reasonings[-1:] * padding,
                                    decision_lists + decision_lists[-1:] * padding).mean(0)[:len(owners)]
        owners_t = torch.tensor(owners, device=probs.device)
        true = probs.gather(-1, decisions[owners_t][:, None]).squeeze(-1)
        k_max = max(len(e) for e in inputs.sentence_ends)
        table = torch.zeros(len(inputs.sentence_ends), k_max + 1, device=probs.device)
        mask = torch.zeros_like(table, dtype=torch.bool)
        start = 0
        for b, ends in enumerate(inputs.sentence_ends):
            table[b, : len(ends) + 1] = true[start:start + len(ends) + 1]
            mask[b, : len(ends) + 1] = True
            start += len(ends) + 1
        return table, mask

    def _ppo(self, batch: RolloutBatch) -> dict[str, Tensor]:
        hp = self.hparams
        optimizer = self.optimizers()
        schedule = self.lr_schedulers()
        totals: dict[str, list[Tensor]] = {"train/policy_loss": [], "train/clip_fraction": [], "train/approx_kl": []}
        for _ in range(hp.ppo_epochs):
            logprobs = token_logprobs(forward_logits(self.policy, batch), batch.input_ids)
            loss, info = clipped_policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.response_mask,
                                             hp.clip, hp.clip)
            self.manual_backward(loss)
            if hp.max_grad_norm is not None:
                self.clip_gradients(optimizer, gradient_clip_val=hp.max_grad_norm, gradient_clip_algorithm="norm")
            step_groups(optimizer, {"policy"})
            optimizer.zero_grad()
            schedule.step()
            totals["train/policy_loss"].append(loss.detach())
            totals["train/clip_fraction"].append(info["clip_fraction"])
            totals["train/approx_kl"].append(info["approx_kl"])
        return {k: torch.stack(v).mean() for k, v in totals.items()}


def whitened(values: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(x − mean)/std over the masked entries; the PPO advantage of the reward-to-go (no value head)."""
    mask = mask.float()
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    var = ((values - mean).square() * mask).sum() / count
    return (values - mean) / (var.sqrt() + eps) * mask
