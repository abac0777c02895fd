"""Explanation rewards (seed 000, "TPL") on Lightning.

- :class:`ExplanationDataModule`: JSONL rows ``{context, decisions, decision}`` (decision by index or label),
  optionally ``explanation`` (a reference) and ``preferred`` (a preferred explanation, for the SFT start).
- :class:`ExplanationRewardModule`: trains the rectified flow φ alone on given explanations (e.g. the
  data's reference ``explanation`` field), with proxy scoring and rejection sampling.
- :class:`ExplanationPolicyModule`: the paper's rounds (App. F), after an optional SFT on preferred
  explanations: the explanation LLM writes explanations (decision hidden) → K proxies score every candidate →
  rejection sampling → flow training → PPO with LoRA on the flow's sentence rewards. One round spans
  ``policy_epochs_per_round`` trainer epochs; held-out evaluators judge the explanations.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from flowkit.batch import RolloutBatch
from flowkit.data.records import load_records
from flowkit.distributed import all_reduce_int, zero3_sharded
from flowkit.errors import ConfigError, check_nonempty, check_range
from flowkit.explain.flow_data import accepted_flow_data, fit_flow, gather_flow_data
from flowkit.explain.ppo import clipped_value_loss, gae, kl_shaped_rewards, whitened
from flowkit.explain.prompts import formatted_explanation_prompt
from flowkit.explain.proxy import proxy_probabilities, rejection_mask
from flowkit.explain.reward_model import (
    ExplanationInputs,
    FlowRewardModel,
    explanation_inputs,
    place_token_rewards,
)
from flowkit.explain.sentence_rewards import sentence_rewards_from_probs
from flowkit.llm.backbone import load_backbone
from flowkit.llm.chat import PROMPT_FORMATS, PromptFormat, resolve_prompt_format
from flowkit.llm.lora import LoraSettings, apply_lora
from flowkit.llm.rollout import RolloutEngine, encode_pairs, forward_hidden
from flowkit.modules.datamodule import resolve_data_path
from flowkit.modules.optim import step_groups
from flowkit.rl.advantages import reward_to_go
from flowkit.rl.logprobs import token_logprobs
from flowkit.rl.losses import clipped_policy_loss
from flowkit.seeding import run_seed

REFERENCE_ADAPTER = "reference"  # the frozen LoRA adapter holding PPO's initial (post-SFT) policy
RewardMode = Literal["flow", "sparse", "proxy"]
Advantage = Literal["gae", "reinforce"]


def normalize_record(record: dict[str, Any]) -> dict[str, Any]:
    """``decision`` as an index into ``decisions`` (given as an index or as one of the labels)."""
    decisions = [str(d) for d in record["decisions"]]
    decision = record["decision"]
    index = decision if isinstance(decision, int) else decisions.index(str(decision))
    row = {"context": str(record["context"]), "decisions": decisions, "decision": index}
    for optional in ("explanation", "preferred"):  # a reference explanation; the preferred one for SFT
        if record.get(optional):
            row[optional] = str(record[optional])
    return row


def _rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return rows


class ExplanationDataModule(L.LightningDataModule):
    """Decision records for explanation training; ``bundled:gridworld/...`` is the toy task.

    ``seed``: shuffling seed of the training batches; ``None`` (default): the run's global seed
    (``seed_everything``), as :class:`flowkit.modules.RolloutDataModule`; an int pins it.
    """

    def __init__(self, train_path: str = "bundled:gridworld/train.jsonl",
                 test_path: str = "bundled:gridworld/test.jsonl",
                 num_train: int | None = None, num_test: int | None = None, batch_size: int = 12,
                 seed: int | None = None):
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
        generator = torch.Generator().manual_seed(run_seed(self.hparams.seed))
        return DataLoader(self.train_records, batch_size=self.hparams.batch_size, shuffle=True, collate_fn=_rows,
                          generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.test_records, batch_size=self.hparams.batch_size, collate_fn=_rows)


def rank_share(rows: list, rank: int, world_size: int) -> list:
    """Rank ``rank``'s equal share of ``rows``: every ``world_size``-th of the first ⌊len/W⌋·W rows.

    Each rank explains and scores only its share of a round's contexts (the ≤ W − 1 left over are skipped,
    so that every rank does the same number of generation and scoring collectives under ZeRO-3); the flow's
    data are then gathered, so every rank's flow trains on the union
    (:func:`~flowkit.explain.flow_data.gather_flow_data`).
    ``rank_share(range(len(rows)), ...)`` gives the shared rows' indices.
    """
    usable = len(rows) // world_size * world_size
    return rows[rank:usable:world_size]


def _check_flow_options(owner: str, proxies: list[str] | None, sigma: float, ode_steps: int, num_draws: int,
                        widths: dict[str, int]) -> None:
    """ConfigError for the options both explanation modules share, before any model loads."""
    if proxies is not None:
        check_nonempty(owner, "proxies", proxies)  # null is the bundled toy proxies; [] is a mistake
    check_range(owner, "sigma", sigma, 0, open_low=True)
    for name, value in [("ode_steps", ode_steps), ("num_draws", num_draws), *widths.items()]:
        check_range(owner, name, value, 1)


def _check_prompt_format(owner: str, prompt_format: str) -> None:
    if prompt_format not in PROMPT_FORMATS:
        raise ConfigError(f"{owner}.prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")


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
    held-out positive and negative rows (rows the first proxy gets right / wrong). ``encode_batch_size``
    rows go through the frozen backbone per pass (only its last layer's K/V are kept); ``prompt_format`` as in
    :class:`ExplanationPolicyModule`.
    """

    def __init__(self, backbone: str = "bundled:explain_tiny/policy",
                 proxies: list[str] | None = None, dtype: str = "float32", trust_remote_code: bool = False,
                 num_decisions: int = 4, sigma: float = 1.0, ode_steps: int = 8, num_draws: int = 16,
                 time_dim: int = 64, projector_dim: int = 256, flow_attention: bool = True, lr: float = 2e-4,
                 encode_batch_size: int = 8, prompt_format: PromptFormat = "auto"):
        super().__init__()
        owner = "ExplanationRewardModule"
        check_range(owner, "num_decisions", num_decisions, 2)
        _check_flow_options(owner, proxies, sigma, ode_steps, num_draws, {"time_dim": time_dim,
                                                                          "projector_dim": projector_dim,
                                                                          "encode_batch_size": encode_batch_size})
        check_range(owner, "lr", lr, 0, open_low=True)
        _check_prompt_format(owner, prompt_format)
        self.save_hyperparameters()
        proxies = proxies or [f"bundled:explain_tiny/proxy{i}" for i in range(3)]
        self.backbone, self.tokenizer = load_backbone(backbone, dtype, trust_remote_code)
        self.backbone.requires_grad_(False).eval()
        self.proxies, self.proxy_tokenizers = load_proxies(proxies, dtype, trust_remote_code)
        self.prompt_format = resolve_prompt_format(prompt_format, self.tokenizer)
        self.proxy_formats = [resolve_prompt_format(prompt_format, t) for t in self.proxy_tokenizers]
        self.reward_model = FlowRewardModel(num_decisions, self.backbone.config.hidden_size, sigma, ode_steps,
                                            num_draws, time_dim, projector_dim, flow_attention, encode_batch_size)
        self.accuracy = torch.nn.ModuleDict({kind: MulticlassAccuracy(num_decisions, average="micro")
                                             for kind in ("positive", "negative")})

    def _encode(self, rows: list[dict[str, Any]]):
        prompts = [formatted_explanation_prompt(r["context"], self.tokenizer, self.prompt_format) for r in rows]
        batch = encode_pairs(self.tokenizer, prompts, [r["explanation"] for r in rows]).to(self.device)
        inputs = explanation_inputs(batch, self.tokenizer)
        probs = proxy_probabilities(list(zip(self.proxies, self.proxy_tokenizers)), [r["context"] for r in rows],
                                    [r["explanation"] for r in rows], [r["decisions"] for r in rows],
                                    prompt_formats=self.proxy_formats)
        return self.reward_model.encode(self.backbone, inputs.input_ids, inputs.attention_mask), probs

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
        evaluators: the LLMs that judge explanation accuracy in evaluation (round starts, ``final/*`` after the
            last round, ``val/*`` under ``flowkit validate``); they should not be training proxies, or the
            accuracy is judged by the models the flow was fitted to. None: the proxies (with a warning).
        reward: ``flow`` (sentence rewards + sparse), ``sparse`` (only the final 1 for a correct flow
            prediction) or ``proxy`` (sentence rewards from the proxies' own probabilities, no flow).
        flow_attention: False is the attention-free ablation (MLP on pooled last-layer latents).
        explanations_per_context: explanations written per training context each round for flow data.
        round_contexts / heldout_contexts: how many train / test contexts a round's flow phase uses (split
            evenly over the ranks: each explains its share, see :func:`rank_share`). The flow's data (the
            accepted explanations' last-layer K/V and the proxies' targets) are gathered from every rank, and
            every rank trains its flow on the union with the same steps and noise: identical flow updates on
            every rank, equal to one rank's over all the contexts.
        flow_epochs_per_round, flow_batch_size, flow_lr: flow training per round (paper: 100, 128, 2e-4);
            ``flow_batch_size`` accepted (explanation, proxy) pairs of the union per step, whatever the rank count.
        policy_epochs_per_round: trainer epochs of PPO per round (paper: 10); ``trainer.max_epochs`` =
            rounds × this.
        num_samples: explanations per context in a PPO batch; lr decays linearly to 0 over training.
        encode_batch_size: explanations per frozen-backbone pass when encoding the flow's context (only the
            last layer's K/V are kept, so a round's encoding peak is one such pass plus those K/V).
        advantage: ``gae`` (default; PPO as TRL's PPO trainer): a value head on the LoRA policy's last hidden
            state, per-token rewards shaped by −kl_coef·(log π_old − log π_ref) against PPO's initial policy,
            the policy after SFT (TRL's reference is the SFT model): without ``sft_epochs`` the adapters-disabled
            model; after SFT a frozen second LoRA adapter holding the SFT'd adapter weights (r·(d_in + d_out)
            per target module, not a model copy; without ``lora``, a frozen full copy), GAE(gamma, lam) advantages
            (whitened) and value targets, and vf_coef × the
            value loss clipped at ±value_clip (TRL defaults: 1.0, 0.95, 0.05, 0.1, 0.2). ``reinforce``: the
            whitened reward-to-go, no value head and no KL (the earlier estimator, kept as an ablation).
        ppo_epochs, clip: optimizer steps per PPO batch (TRL default 4) and the ratio clip ε; from the
            second step on, the ratio differs from 1 and the clip acts (``train/clip_fraction``).
        sft_epochs, sft_lr: epochs of SFT on the training records' ``preferred`` explanations before the
            first round (paper: 3 epochs, lr 2e-5 decaying linearly to 0, App. F; Table 12 shows the rounds
            need it); batches of ``data.batch_size``, ``gradient_accumulation`` of them per step; 0 skips it.
        prompt_format: ``auto`` (default): each model's tokenizer chat template when it has one (instruct
            models), else the plain prompts; ``chat`` / ``text`` force one (see :mod:`flowkit.explain.prompts`).
        gradient_accumulation: training batches (each ``data.batch_size`` contexts per rank) rolled out
            before one PPO batch is optimised; the paper's batch 12 is 1 per GPU × 3 × 4 GPUs.
        max_grad_norm: clipping of the PPO steps. Under DeepSpeed it is not applied (Lightning leaves clipping
            to DeepSpeed, whose ``gradient_clipping`` would clip the flow's steps too); a warning says so.
        seed: seed of the flow's noise (training, prediction and reward draws) and of the flow-batch order;
            ``None`` (default): the run's global seed (``seed_everything``); an int pins it. The flow's
            training in round i draws from seed + i, agreed over the ranks.
    """

    def __init__(
        self,
        policy: str = "bundled:explain_tiny/policy",
        proxies: list[str] | None = None,
        evaluators: list[str] | None = None,
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
        encode_batch_size: int = 8,
        prompt_format: PromptFormat = "auto",
        sft_epochs: int = 0,
        sft_lr: float = 2e-5,
        ppo_epochs: int = 4,
        clip: float = 0.2,
        advantage: Advantage = "gae",
        gamma: float = 1.0,
        lam: float = 0.95,
        kl_coef: float = 0.05,
        vf_coef: float = 0.1,
        value_clip: float = 0.2,
        gradient_accumulation: int = 1,
        lr: float = 2e-5,
        flow_lr: float = 2e-4,
        max_grad_norm: float | None = 1.0,
        seed: int | None = None,
    ):
        super().__init__()
        owner = "ExplanationPolicyModule"
        if reward not in ("flow", "sparse", "proxy"):
            raise ConfigError(f"{owner}.reward must be flow, sparse or proxy, got {reward!r}")
        if advantage not in ("gae", "reinforce"):
            raise ConfigError(f"{owner}.advantage must be gae or reinforce, got {advantage!r}")
        _check_flow_options(owner, proxies, sigma, ode_steps, num_draws, {"flow_time_dim": flow_time_dim,
                                                                          "flow_projector_dim": flow_projector_dim,
                                                                          "encode_batch_size": encode_batch_size})
        for name, value in [("explanations_per_context", explanations_per_context), ("round_contexts", round_contexts),
                            ("heldout_contexts", heldout_contexts), ("flow_epochs_per_round", flow_epochs_per_round),
                            ("flow_batch_size", flow_batch_size), ("policy_epochs_per_round", policy_epochs_per_round),
                            ("num_samples", num_samples), ("max_new_tokens", max_new_tokens),
                            ("generation_batch_size", generation_batch_size), ("ppo_epochs", ppo_epochs),
                            ("gradient_accumulation", gradient_accumulation)]:
            check_range(owner, name, value, 1)
        for name, value in [("sparse_reward", sparse_reward), ("temperature", temperature),
                            ("eval_temperature", eval_temperature), ("seed", seed), ("kl_coef", kl_coef),
                            ("vf_coef", vf_coef), ("sft_epochs", sft_epochs)]:
            check_range(owner, name, value, 0)
        for name, value in [("gamma", gamma), ("lam", lam)]:
            check_range(owner, name, value, 0, 1)
        check_range(owner, "value_clip", value_clip, 0, open_low=True)
        for name, value in [("lr", lr), ("flow_lr", flow_lr), ("max_grad_norm", max_grad_norm), ("sft_lr", sft_lr)]:
            check_range(owner, name, value, 0, open_low=True)
        check_range(owner, "clip", clip, 0, 1, open_high=True)  # the ratio's lower bound 1 − ε must be > 0
        _check_prompt_format(owner, prompt_format)
        if evaluators is not None:
            check_nonempty(owner, "evaluators", evaluators)
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.policy, self.tokenizer = load_backbone(policy, dtype, trust_remote_code)
        if lora is not None:
            self.policy = apply_lora(self.policy, lora)
            self.flow_backbone = None  # encoding disables the adapters: the frozen base reads
        else:
            self.flow_backbone, _ = load_backbone(policy, dtype, trust_remote_code)
            self.flow_backbone.requires_grad_(False).eval()
        self.reference_policy = None  # the frozen post-SFT copy when SFT runs without LoRA (_build_reference)
        proxies = proxies or [f"bundled:explain_tiny/proxy{i}" for i in range(3)]
        self.proxies, self.proxy_tokenizers = load_proxies(proxies, dtype, trust_remote_code)
        self.prompt_format = resolve_prompt_format(prompt_format, self.tokenizer)
        self.proxy_formats = [resolve_prompt_format(prompt_format, t) for t in self.proxy_tokenizers]
        self.evaluators, self.evaluator_tokenizers, self._evaluator_formats = None, [], []
        if evaluators is not None:
            self.evaluators, self.evaluator_tokenizers = load_proxies(evaluators, dtype, trust_remote_code)
            self._evaluator_formats = [resolve_prompt_format(prompt_format, t) for t in self.evaluator_tokenizers]
        self.engine = RolloutEngine(self.policy, self.tokenizer, max_new_tokens, temperature)
        self.reward_model: FlowRewardModel | None = None  # built in setup(), once |A| is known
        # The value head on the LoRA policy's last hidden state (TRL's AutoModelForCausalLMWithValueHead).
        self.value_head = torch.nn.Linear(self.policy.config.hidden_size, 1) if advantage == "gae" else None
        self._rollouts: list[RolloutBatch] = []  # the PPO batch being gathered over gradient_accumulation steps
        self.sft_losses: list[float] = []
        self.accuracy = torch.nn.ModuleDict()
        self.evaluation = torch.nn.ModuleDict()
        self.heldout_counts = {"positive": 0, "negative": 0}
        self.generator = torch.Generator().manual_seed(run_seed(seed))
        self._flow_seed = run_seed(seed)  # agreed over the ranks in setup()

    # ------------------------------------------------------------------------------------------- set-up
    def setup(self, stage: str) -> None:
        if isinstance(self.trainer.strategy, DeepSpeedStrategy) and self.hparams.max_grad_norm is not None:
            rank_zero_warn("max_grad_norm is not applied under DeepSpeed; set gradient_clipping in the DeepSpeed "
                           "config to clip (it then clips the flow's steps as well)")
        if self.evaluators is None:
            rank_zero_warn("evaluators is not set: explanation accuracy is judged by the training proxies")
        self._build_reference()
        # The flow's training noise and batch order must be the same on every rank (see _train_flow).
        self._flow_seed = all_reduce_int(self._flow_seed, ReduceOp.MAX)
        if self.reward_model is None:
            num_decisions = self.trainer.datamodule.num_decisions
            hp = self.hparams
            self.reward_model = FlowRewardModel(num_decisions, self.policy.config.hidden_size, hp.sigma,
                                                hp.ode_steps, hp.num_draws, hp.flow_time_dim, hp.flow_projector_dim,
                                                hp.flow_attention, hp.encode_batch_size)
            self.accuracy = torch.nn.ModuleDict({kind: MulticlassAccuracy(num_decisions, average="micro")
                                                 for kind in ("positive", "negative")})
            self.evaluation = torch.nn.ModuleDict({name: MeanMetric() for name in
                                                   ("explanation_accuracy", "reward_mean", "reward_std")})

    def _build_reference(self) -> None:
        """PPO's KL reference after SFT, frozen (see :meth:`_reference_logprobs`): a second LoRA adapter,
        without LoRA a full copy. Built here, before the strategy wraps the model and a checkpoint restores
        it; filled after SFT by :meth:`_snapshot_reference`. Without SFT the reference needs nothing."""
        hp = self.hparams
        if not hp.sft_epochs or hp.advantage != "gae":
            return
        # Its initial weights are overwritten after SFT: drawing them must not move the run's random stream
        # (the flow's initialisation and the sampling would otherwise differ from a run without it).
        with torch.random.fork_rng(devices=[]):
            if self.flow_backbone is None:  # LoRA: added frozen and inactive
                if REFERENCE_ADAPTER not in self.policy.peft_config:
                    self.policy.add_adapter(REFERENCE_ADAPTER, copy.deepcopy(self.policy.peft_config["default"]))
            elif self.reference_policy is None:
                self.reference_policy, _ = load_backbone(hp.policy, hp.dtype, hp.trust_remote_code)
                self.reference_policy.requires_grad_(False).eval()

    def configure_optimizers(self):
        """One Adam: LoRA and the value head (lr, linear decay to 0) and φ (flow_lr, fixed) — App. F."""
        hp = self.hparams
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": hp.lr, "name": "policy"},
                  {"params": list(self.reward_model.parameters()), "lr": hp.flow_lr, "name": "flow"}]
        if self.value_head is not None:
            groups.append({"params": list(self.value_head.parameters()), "lr": hp.lr, "name": "value"})
        optimizer = torch.optim.Adam(groups)
        steps, epochs = int(self.trainer.estimated_stepping_batches), self.trainer.max_epochs
        # Every epoch ends with a (possibly short) PPO batch, so the count is per epoch.
        ppo_batches = (epochs * math.ceil(steps / epochs / hp.gradient_accumulation) if epochs and epochs > 0
                       else math.ceil(steps / hp.gradient_accumulation))
        total = max(1, ppo_batches * hp.ppo_epochs)
        decay = lambda s: max(0.0, 1 - s / total)  # noqa: E731
        fixed = lambda s: 1.0  # noqa: E731
        lambdas = [decay, fixed] + [decay] * (self.value_head is not None)  # policy, flow[, value]
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        return [optimizer], [schedule]

    @property
    def _flow_backbone(self):
        return self.flow_backbone if self.flow_backbone is not None else self.policy

    @property
    def _proxy_pairs(self) -> list:
        return list(zip(self.proxies, self.proxy_tokenizers))

    @property
    def _evaluator_pairs(self) -> list:
        return list(zip(self.evaluators, self.evaluator_tokenizers)) if self.evaluators is not None else \
            self._proxy_pairs

    @property
    def evaluator_formats(self) -> list[str]:
        return self._evaluator_formats if self.evaluators is not None else self.proxy_formats

    # --------------------------------------------------------------------------------------- generation
    def _explain(self, rows: list[dict[str, Any]], n: int, temperature: float) -> RolloutBatch:
        prompts = [formatted_explanation_prompt(r["context"], self.tokenizer, self.prompt_format) for r in rows]
        size = self.hparams.generation_batch_size
        return RolloutBatch.cat([self.engine.generate(prompts[i:i + size], n=n, temperature=temperature)
                                 for i in range(0, len(prompts), size)])

    def _proxy_probs(self, rows: list[dict[str, Any]], responses: list[str], n: int) -> Tensor:
        """[K_p, B·n, |A|] proxy probabilities for ``responses`` (n per row, grouped)."""
        repeated = [r for r in rows for _ in range(n)]
        return proxy_probabilities(self._proxy_pairs, [r["context"] for r in repeated], responses,
                                   [r["decisions"] for r in repeated], prompt_formats=self.proxy_formats)

    # ------------------------------------------------------------------------------------- SFT start
    def on_fit_start(self) -> None:
        if self.hparams.sft_epochs and self.trainer.global_step == 0 and self.current_epoch == 0:
            self._sft(self.trainer.datamodule.train_records)
            self._snapshot_reference()  # a resumed run restores the snapshot from its checkpoint instead

    def _snapshot_reference(self) -> None:
        """Copies the post-SFT policy into PPO's KL reference: the trainable adapter into the frozen
        ``reference`` adapter (without LoRA, all weights into the frozen copy). Under ZeRO-3 the shards are
        gathered for the copy and the reference re-partitioned from rank 0 (every rank takes part)."""
        if self.hparams.advantage != "gae":
            return
        if self.reference_policy is not None:
            pairs = list(zip(self.policy.parameters(), self.reference_policy.parameters(), strict=True))
        else:
            params = dict(self.policy.named_parameters())
            pairs = [(param, params[name.replace(".default.", f".{REFERENCE_ADAPTER}.")])
                     for name, param in params.items() if "lora_" in name and ".default." in name]
        sharded = zero3_sharded(p for pair in pairs for p in pair)
        if sharded:
            import deepspeed  # sharded parameters mean DeepSpeed is installed
        with torch.no_grad():
            for source, target in pairs:  # one parameter gathered at a time
                read = deepspeed.zero.GatheredParameters([source], modifier_rank=None) if sharded else nullcontext()
                write = deepspeed.zero.GatheredParameters([target], modifier_rank=0) if sharded else nullcontext()
                with read, write:
                    target.copy_(source)

    def _sft(self, records: list[dict[str, Any]]) -> None:
        """Cross-entropy on the ``preferred`` explanation tokens given x^e (LoRA only under ``lora``), with the
        policy group of the module's Adam at ``sft_lr`` decaying linearly to 0; the per-step losses are kept
        in ``sft_losses`` and sent to the logger as ``sft/loss``."""
        hp = self.hparams
        missing = sum("preferred" not in r for r in records)
        if missing:
            raise ValueError(f"sft_epochs = {hp.sft_epochs} needs a 'preferred' explanation in every training "
                             f"record; {missing} of {len(records)} have none")
        optimizer = self.optimizers()
        policy_group = next(g for g in optimizer.param_groups if g["name"] == "policy")
        round_lr = policy_group["lr"]
        size, accumulation = self.trainer.datamodule.hparams.batch_size, hp.gradient_accumulation
        generator = torch.Generator().manual_seed(run_seed(hp.seed))
        batches = [torch.randperm(len(records), generator=generator).split(size) for _ in range(hp.sft_epochs)]
        batches = [b for epoch in batches for b in epoch]
        steps = math.ceil(len(batches) / accumulation)
        try:
            for step in range(steps):
                policy_group["lr"] = hp.sft_lr * (1 - step / steps)
                chunk = [self._sft_batch([records[i] for i in index])
                         for index in batches[step * accumulation:(step + 1) * accumulation]]
                tokens = sum(batch.response_mask.sum() for batch in chunk)
                loss = 0.0
                for batch in chunk:
                    logprobs = self._logprobs(self.policy, forward_hidden(self.policy, batch), batch)
                    part = -(logprobs * batch.response_mask).sum() / tokens  # token mean over the whole step
                    self.manual_backward(part)
                    loss += part.detach()
                if hp.max_grad_norm is not None:
                    self.clip_gradients(optimizer, gradient_clip_val=hp.max_grad_norm, gradient_clip_algorithm="norm")
                step_groups(optimizer, {"policy"})
                optimizer.zero_grad()
                self.sft_losses.append(float(loss))
                if self.logger is not None:
                    self.logger.log_metrics({"sft/loss": float(loss)}, step=step)
        finally:
            policy_group["lr"] = round_lr

    def _sft_batch(self, rows: list[dict[str, Any]]) -> RolloutBatch:
        prompts = [formatted_explanation_prompt(r["context"], self.tokenizer, self.prompt_format) for r in rows]
        return encode_pairs(self.tokenizer, prompts, [r["preferred"] for r in rows]).to(self.device)

    # ------------------------------------------------------------------------------------ round: flow
    def on_train_epoch_start(self) -> None:
        hp = self.hparams
        if self.current_epoch % hp.policy_epochs_per_round:
            return
        datamodule = self.trainer.datamodule
        round_records = datamodule.train_records[: hp.round_contexts]
        rows = self._rank_share(round_records, "round_contexts")
        heldout = self._rank_share(datamodule.test_records[: hp.heldout_contexts], "heldout_contexts")
        n = hp.explanations_per_context
        with torch.no_grad():
            batch = self._explain(rows, n, hp.temperature)
            probs = self._proxy_probs(rows, batch.responses, n)
            decisions = decision_tensor(rows, self.device, n)
            kept = rejection_mask(probs, decisions)
        self.log("round/acceptance", kept.float().mean())
        round_index = self.current_epoch // hp.policy_epochs_per_round
        self.log("round/index", float(round_index))
        if hp.reward != "proxy":
            # Explanation j of the round's context c is row c·n + j of the round, on whichever rank wrote it.
            contexts = torch.tensor(rank_share(range(len(round_records)), self.global_rank, self.trainer.world_size))
            row_ids = (contexts[:, None] * n + torch.arange(n)).flatten()
            self._train_flow(batch, probs, kept, row_ids, round_index)
        self._evaluate_heldout(heldout)

    def _rank_share(self, rows: list[dict[str, Any]], option: str) -> list[dict[str, Any]]:
        """This rank's share of a round's contexts (see :func:`rank_share`)."""
        world = self.trainer.world_size
        if 0 < len(rows) < world:
            raise ValueError(f"{option} gives {len(rows)} contexts for {world} ranks; every rank needs at least one")
        return rank_share(rows, self.global_rank, world)

    def _train_flow(self, batch: RolloutBatch, probs: Tensor, kept: Tensor, row_ids: Tensor,
                    round_index: int) -> None:
        """Eq. 3 on the accepted (explanation, proxy) pairs of every rank for ``flow_epochs_per_round`` epochs.

        Each rank encodes its accepted explanations; :func:`gather_flow_data` joins every rank's (a
        collective), and every rank takes the same steps over the union with a generator seeded alike
        (seed + round): the flow's updates are identical on every rank and equal to one rank's over the whole
        round, and the strategy's gradient averaging (DDP, DeepSpeed) averages equal gradients. Under ZeRO-3
        every rank thus also runs the same flow collectives. Logs ``round/flow_pairs`` (the union's accepted
        pairs) and ``round/flow_loss`` (mean of the last tenth of the steps; NaN when no rank accepted any).
        """
        hp = self.hparams
        local = accepted_flow_data(self.reward_model, self._flow_backbone, explanation_inputs(batch, self.tokenizer),
                                   probs, kept, row_ids)
        data = gather_flow_data(local)
        generator = torch.Generator().manual_seed(self._flow_seed + round_index)  # CPU: the same draws on any device
        optimizer = self.optimizers()

        def step(loss: Tensor) -> None:
            self.manual_backward(loss)
            step_groups(optimizer, {"flow"})
            optimizer.zero_grad()

        losses = fit_flow(self.reward_model, data, hp.flow_epochs_per_round, hp.flow_batch_size, generator, step)
        self.log("round/flow_pairs", float(len(data.pairs()[0])))
        self.log("round/flow_loss", torch.stack(losses[-max(1, len(losses) // 10):]).mean() if losses
                 else torch.tensor(float("nan")))

    def _evaluate_heldout(self, rows: list[dict[str, Any]], prefix: str = "round") -> None:
        """Evaluate explanations for unseen contexts (``rows``) and log them as ``{prefix}/*``."""
        size = self.hparams.generation_batch_size
        for start in range(0, len(rows), size):
            self._update_evaluation(rows[start:start + size])
        self._log_evaluation(prefix)

    @torch.no_grad()
    def _update_evaluation(self, rows: list[dict[str, Any]]) -> None:
        """One explanation per row at ``eval_temperature``, judged by the evaluators (not the training proxies
        unless ``evaluators`` is unset): explanation accuracy (mean over evaluators of argmax = true decision)
        and, with a flow, its accuracy on positives/negatives (first evaluator right/wrong) and its reward
        (mean z1[a*] over draws) mean and std over draws."""
        if not rows:
            return
        batch = self._explain(rows, 1, self.hparams.eval_temperature)
        repeated = [r["context"] for r in rows]
        probs = proxy_probabilities(self._evaluator_pairs, repeated, batch.responses, [r["decisions"] for r in rows],
                                    prompt_formats=self.evaluator_formats)
        decisions = decision_tensor(rows, self.device)
        self.evaluation["explanation_accuracy"].update((probs.argmax(-1) == decisions).float().mean(0))
        if self.hparams.reward == "proxy":
            return
        inputs = explanation_inputs(batch, self.tokenizer)
        context = self.reward_model.encode(self._flow_backbone, inputs.input_ids, inputs.attention_mask)
        draws = self.reward_model.predict_draws(context, self.generator)  # [B, M, |A|]
        true = draws.gather(-1, decisions[:, None, None].expand(-1, draws.shape[1], 1)).squeeze(-1)
        self.evaluation["reward_mean"].update(true.mean(-1))
        self.evaluation["reward_std"].update(true.std(-1))
        predicted = draws.mean(1).argmax(-1)
        positive = rejection_mask(probs[0], decisions)
        for kind, mask in (("positive", positive), ("negative", ~positive)):
            if mask.any():
                self.accuracy[kind].update(predicted[mask], decisions[mask])
            self.heldout_counts[kind] += int(mask.sum())

    def _log_evaluation(self, prefix: str) -> None:
        """Logs and resets the evaluation metrics. compute() gathers every rank's state (a collective), so
        whether to call it is decided on counts over all ranks, and a rank without rows of a kind still joins."""
        for name, metric in self.evaluation.items():
            if all_reduce_int(int(metric.update_count), ReduceOp.SUM):
                self.log(f"{prefix}/{name}", metric.compute())
            metric.reset()
        for kind, metric in self.accuracy.items():
            heldout = all_reduce_int(self.heldout_counts[kind], ReduceOp.SUM)
            if heldout:
                self.log(f"{prefix}/flow_accuracy_{kind}", metric.compute())
                self.log(f"{prefix}/heldout_{kind}s", float(heldout))
            metric.reset()
            self.heldout_counts[kind] = 0

    def on_train_epoch_end(self) -> None:
        """The final evaluation, after the last round's last PPO epoch: ``final/*`` on the held-out contexts."""
        if self.current_epoch + 1 == self.trainer.max_epochs:
            heldout = self.trainer.datamodule.test_records[: self.hparams.heldout_contexts]
            self._evaluate_heldout(self._rank_share(heldout, "heldout_contexts"), "final")

    def validation_step(self, rows: list[dict[str, Any]], batch_idx: int) -> None:
        """``flowkit validate``: the same evaluation over the test split, logged as ``val/*``."""
        self._update_evaluation(rows)

    def on_validation_epoch_end(self) -> None:
        self._log_evaluation("val")

    # -------------------------------------------------------------------------------------- PPO step
    def training_step(self, rows: list[dict[str, Any]], batch_idx: int) -> None:
        """Roll out and score ``rows``; every ``gradient_accumulation`` steps (and at an epoch's last batch),
        the buffered rollouts are one PPO batch: ``ppo_epochs`` passes, one optimizer step per pass."""
        hp = self.hparams
        with torch.no_grad():
            batch, metrics = self._rollout(rows)
        self._rollouts.append(batch)
        last = batch_idx + 1 == self.trainer.num_training_batches
        if len(self._rollouts) == hp.gradient_accumulation or last:
            metrics.update(self._ppo(self._rollouts))
            self._rollouts = []
        self.log_dict(metrics, prog_bar=False, batch_size=batch.batch_size)

    def _rollout(self, rows: list[dict[str, Any]]) -> tuple[RolloutBatch, dict[str, Tensor]]:
        """Explanations for ``rows`` with their token rewards, old log-probs and advantages (``gae``: also
        the reference log-probs, the KL-shaped rewards, old values and value targets)."""
        hp = self.hparams
        n = hp.num_samples
        batch = self._explain(rows, n, hp.temperature)
        decisions = decision_tensor(rows, self.device, n)
        inputs = explanation_inputs(batch, self.tokenizer)
        rewards, sparse, metrics = self._rewards(rows, batch, inputs, decisions)
        batch.token_rewards = place_token_rewards(tuple(batch.input_ids.shape), inputs, rewards, sparse)
        batch.correct = sparse > 0
        mask = batch.response_mask
        hidden = forward_hidden(self.policy, batch)
        batch.old_logprobs = self._logprobs(self.policy, hidden, batch)
        metrics["train/return"] = batch.token_rewards.sum(-1).mean()
        metrics["train/response_length"] = batch.response_lengths.float().mean()
        if hp.advantage == "reinforce":
            batch.advantages = whitened(reward_to_go(batch.token_rewards, mask), mask)
            return batch, metrics
        ref_logprobs = self._reference_logprobs(batch)
        shaped = kl_shaped_rewards(batch.token_rewards, batch.old_logprobs, ref_logprobs, mask, hp.kl_coef)
        batch.old_values = self._values(hidden, mask)
        advantages, batch.returns = gae(shaped, batch.old_values, mask, hp.gamma, hp.lam)
        batch.advantages = whitened(advantages, mask)
        metrics["train/kl_to_initial"] = ((batch.old_logprobs - ref_logprobs) * mask).sum(-1).mean()
        return batch, metrics

    def _reference_logprobs(self, batch: RolloutBatch) -> Tensor:
        """Log-probs under PPO's initial policy, the policy after SFT (TRL's reference model is the SFT model).

        Without SFT: the LoRA policy with its adapters disabled (without LoRA, the frozen copy the flow
        reads). After ``sft_epochs``: the LoRA policy reading the frozen ``reference`` adapter, which holds the
        post-SFT adapter weights (without LoRA, the frozen post-SFT copy)."""
        frozen = self.reference_policy if self.reference_policy is not None else self.flow_backbone
        if frozen is not None:
            return self._logprobs(frozen, forward_hidden(frozen, batch), batch)
        with self._reference_adapter():
            return self._logprobs(self.policy, forward_hidden(self.policy, batch), batch)

    @contextmanager
    def _reference_adapter(self):
        """The LoRA policy as PPO's reference while inside: the frozen ``reference`` adapter active, or,
        without SFT, the adapters disabled. On leaving, the trainable ``default`` adapter is active again
        (peft's set_adapter also sets which adapter requires grad)."""
        if REFERENCE_ADAPTER not in self.policy.peft_config:
            with self.policy.disable_adapter():
                yield
            return
        self.policy.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
        try:
            yield
        finally:
            self.policy.set_adapter("default")

    @staticmethod
    def _logprobs(model, hidden: Tensor, batch: RolloutBatch) -> Tensor:
        """Token log-probs (aligned with ``input_ids``) from ``model``'s last hidden state through its LM head.

        The head runs as a plain module call: :func:`flowkit.rl.logprobs.lm_head_logprobs`' checkpointed
        chunks recompute it in the backward, where ZeRO-3 has re-partitioned its weight (a shape mismatch).
        """
        return token_logprobs(model.get_output_embeddings()(hidden), batch.input_ids)

    def _values(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """V(state before token t) at response token t: the value head on the hidden state at t − 1."""
        values = self.value_head(hidden.float()).squeeze(-1)
        return torch.nn.functional.pad(values[:, :-1], (1, 0)) * mask

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
                                    decision_lists + decision_lists[-1:] * padding,
                                    prompt_formats=self.proxy_formats).mean(0)[:len(owners)]
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

    def _ppo(self, rollouts: list[RolloutBatch]) -> dict[str, Tensor]:
        """``ppo_epochs`` optimizer steps on the buffered rollouts, each accumulating their gradients: the
        clipped surrogate (its ratio moves off 1 after the first step, so clipping acts) plus, for ``gae``,
        ``vf_coef`` × the clipped value loss."""
        hp = self.hparams
        optimizer = self.optimizers()
        schedule = self.lr_schedulers()
        totals: dict[str, list[Tensor]] = {"train/policy_loss": [], "train/clip_fraction": [], "train/approx_kl": []}
        if hp.advantage == "gae":
            totals["train/value_loss"] = []
        tokens = sum(b.response_mask.sum() for b in rollouts).clamp(min=1)
        for _ in range(hp.ppo_epochs):
            for batch in rollouts:
                hidden = forward_hidden(self.policy, batch)
                share = batch.response_mask.sum() / tokens  # token-mean over the whole PPO batch
                logprobs = self._logprobs(self.policy, hidden, batch)
                loss, info = clipped_policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.response_mask,
                                                 hp.clip, hp.clip)
                totals["train/policy_loss"].append(loss.detach())
                if hp.advantage == "gae":
                    value_loss = clipped_value_loss(self._values(hidden, batch.response_mask), batch.old_values,
                                                    batch.returns, batch.response_mask, hp.value_clip)
                    totals["train/value_loss"].append(value_loss.detach())
                    loss = loss + hp.vf_coef * value_loss
                self.manual_backward(share * loss)
                totals["train/clip_fraction"].append(info["clip_fraction"])
                totals["train/approx_kl"].append(info["approx_kl"])
            if hp.max_grad_norm is not None:
                self.clip_gradients(optimizer, gradient_clip_val=hp.max_grad_norm, gradient_clip_algorithm="norm")
            step_groups(optimizer, {"policy", "value"})
            optimizer.zero_grad()
            schedule.step()
        return {k: torch.stack(v).mean() for k, v in totals.items()}
