"""TPL's explanation reward (seed 000 §3) as a :class:`TokenRewardModel` of the shared RL engine.

A rectified flow φ over the decision logits reads a frozen LLM's last layer through two flow tokens; per explanation
it gives sentence rewards p(a*|s^{1:k}) − p(a*|s^{1:k−1}) (eq. 5) from one backbone pass, plus a sparse reward when
its prediction is the true decision (§3.2). φ does not learn inside an RL step: it is fitted once per round
(:meth:`ExplanationReward.fit_round`, driven by :class:`flowkit.modules.ExplanationRounds`) on the explanations the
proxies accept (rejection sampling, eq. 3). Per row the reward model reads the data's columns ``context``,
``decisions`` and ``decision`` (an index), which :class:`flowkit.modules.ExplanationDataModule` provides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.distributed import ReduceOp

from flowkit.batch import RolloutBatch
from flowkit.distributed import all_reduce_int
from flowkit.errors import ConfigError, check_nonempty, check_range
from flowkit.explain.evaluators import GenerativeEvaluator, LogitEvaluator, explanation_accuracy
from flowkit.explain.flow_data import accepted_flow_data, fit_flow, gather_flow_data
from flowkit.explain.proxy import proxy_probabilities, rejection_mask
from flowkit.explain.reward_model import ExplanationFlowModel, ExplanationInputs, explanation_inputs, place_token_rewards
from flowkit.explain.sentence_rewards import sentence_rewards_from_probs
from flowkit.llm.backbone import load_backbone
from flowkit.llm.chat import PROMPT_FORMATS, PromptFormat, resolve_prompt_format
from flowkit.llm.chat_backends import ChatBackend
from flowkit.rewards.base import TokenRewardModel
from flowkit.seeding import run_seed

log = logging.getLogger(__name__)

RewardMode = Literal["flow", "sparse", "proxy"]


def rank_share(rows: list, rank: int, world_size: int) -> list:
    """Rank ``rank``'s equal share of ``rows``: every ``world_size``-th of the first ⌊len/W⌋·W rows.

    Each rank explains and scores only its share of a round's contexts (the ≤ W − 1 left over are skipped, so that
    every rank does the same number of generation and scoring collectives under ZeRO-3); the flow's data are then
    gathered, so every rank's flow trains on the union (:func:`~flowkit.explain.flow_data.gather_flow_data`).
    ``rank_share(range(len(rows)), ...)`` gives the shared rows' indices.
    """
    usable = len(rows) // world_size * world_size
    return rows[rank:usable:world_size]


def load_frozen(paths: Sequence[str], dtype: str, trust_remote_code: bool) -> tuple[nn.ModuleList, list]:
    models, tokenizers = nn.ModuleList(), []
    for path in paths:
        model, tokenizer = load_backbone(path, dtype, trust_remote_code)
        models.append(model.requires_grad_(False).eval())
        tokenizers.append(tokenizer)
    return models, tokenizers


class ExplanationReward(TokenRewardModel):
    """Sentence rewards for explanations of a hidden decision (seed 000 §3.2, App. C, App. F).

    Args:
        num_decisions: |A|, the candidates per record (the data must agree).
        proxies: the K_p proxy LLMs that judge explanations for the flow's data (paper: 3); null is the bundled toy's.
        evaluators: local LLMs that judge explanation accuracy in evaluation; they should not be training proxies
            (else accuracy is judged by the models the flow was fitted to). Null: the proxies (with a warning).
        judge: a chat backend (e.g. ``flowkit.llm.chat_backends.HTTPChatBackend``, an OpenAI-compatible endpoint) asked
            which decision an explanation implies, as the paper's GPT-4o judge (:class:`GenerativeEvaluator`), in
            addition to ``evaluators``; judge_temperature: its sampling temperature.
        backbone: the frozen LLM whose last layer the flow reads; null (default): the policy with its LoRA adapters
            disabled (the paper: the explanation LLM itself, frozen), which needs a LoRA policy.
        dtype, trust_remote_code, prompt_format: how the proxies / evaluators / backbone load and read prompts.
        reward: ``flow`` (sentence rewards + sparse), ``sparse`` (the final reward only) or ``proxy`` (sentence
            rewards from the proxies' own probabilities of each prefix, no flow: the paper's proxy baseline).
        sparse_reward: the reward on the last token when the flow (``proxy``: the proxies' mean) predicts the decision.
        flow_attention: false is the attention-free ablation (an MLP on pooled last-layer latents).
        sigma, ode_steps, num_draws, flow_time_dim, flow_projector_dim: φ and its sampling (App. C).
        encode_batch_size: explanations per frozen-backbone pass when encoding the flow's context.
        explanations_per_context: explanations written per context each round for the flow's data (paper: 3).
        round_contexts, heldout_contexts: train / test contexts a round uses (split evenly over the ranks); null: all.
        flow_epochs_per_round, flow_batch_size: the flow's fitting per round (paper: 100 epochs, batch 128 pairs of
            the union of every rank's accepted explanations); its learning rate is the policy module's ``flow_lr``.
        eval_temperature: sampling temperature of the explanations judged in evaluation (paper: 0.7).
        seed: the flow's noise (fitting, prediction, reward draws) and batch order; null: the run's seed.
    """

    percentiles = None

    def __init__(
        self,
        num_decisions: int = 4,
        proxies: list[str] | None = None,
        evaluators: list[str] | None = None,
        judge: ChatBackend | None = None,
        judge_temperature: float = 0.0,
        backbone: str | None = None,
        dtype: str = "float32",
        trust_remote_code: bool = False,
        prompt_format: PromptFormat = "auto",
        reward: RewardMode = "flow",
        sparse_reward: float = 1.0,
        flow_attention: bool = True,
        sigma: float = 1.0,
        ode_steps: int = 8,
        num_draws: int = 16,
        flow_time_dim: int = 64,
        flow_projector_dim: int = 256,
        encode_batch_size: int = 8,
        explanations_per_context: int = 3,
        round_contexts: int | None = None,
        heldout_contexts: int | None = None,
        flow_epochs_per_round: int = 100,
        flow_batch_size: int = 128,
        eval_temperature: float = 0.7,
        seed: int | None = None,
    ):
        super().__init__()
        owner = "ExplanationReward"
        check_range(owner, "num_decisions", num_decisions, 2)
        if proxies is not None:
            check_nonempty(owner, "proxies", proxies)  # null is the bundled toy proxies; [] is a mistake
        if evaluators is not None:
            check_nonempty(owner, "evaluators", evaluators)
        if reward not in ("flow", "sparse", "proxy"):
            raise ConfigError(f"{owner}.reward must be flow, sparse or proxy, got {reward!r}")
        if prompt_format not in PROMPT_FORMATS:
            raise ConfigError(f"{owner}.prompt_format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")
        check_range(owner, "sigma", sigma, 0, open_low=True)
        for name, value in [("ode_steps", ode_steps), ("num_draws", num_draws), ("flow_time_dim", flow_time_dim),
                            ("flow_projector_dim", flow_projector_dim), ("encode_batch_size", encode_batch_size),
                            ("explanations_per_context", explanations_per_context), ("round_contexts", round_contexts),
                            ("heldout_contexts", heldout_contexts), ("flow_epochs_per_round", flow_epochs_per_round),
                            ("flow_batch_size", flow_batch_size)]:
            check_range(owner, name, value, 1)
        for name, value in [("sparse_reward", sparse_reward), ("eval_temperature", eval_temperature), ("seed", seed),
                            ("judge_temperature", judge_temperature)]:
            check_range(owner, name, value, 0)
        self.num_decisions, self.reward, self.sparse_reward = num_decisions, reward, sparse_reward
        self.flow_options = dict(sigma=sigma, num_steps=ode_steps, num_draws=num_draws, time_dim=flow_time_dim,
                                 projector_dim=flow_projector_dim, use_attention=flow_attention,
                                 encode_batch_size=encode_batch_size)
        self.explanations_per_context, self.round_contexts = explanations_per_context, round_contexts
        self.heldout_contexts, self.eval_temperature = heldout_contexts, eval_temperature
        self.flow_epochs_per_round, self.flow_batch_size = flow_epochs_per_round, flow_batch_size
        self.prompt_format = prompt_format
        proxies = proxies or [f"bundled:explain_tiny/proxy{i}" for i in range(3)]
        self.proxies, self.proxy_tokenizers = load_frozen(proxies, dtype, trust_remote_code)
        self.proxy_formats = [resolve_prompt_format(prompt_format, t) for t in self.proxy_tokenizers]
        self.evaluators = nn.ModuleList(LogitEvaluator(model, tokenizer, prompt_format)
                                        for model, tokenizer in zip(*load_frozen(evaluators or [], dtype, trust_remote_code)))
        self.judges = [GenerativeEvaluator(judge, judge_temperature)] if judge is not None else []
        if not self.evaluators and not self.judges:
            log.warning("ExplanationReward: no evaluators and no judge: explanation accuracy is judged by the training "
                        "proxies")
        self.frozen_backbone = None
        if backbone is not None:
            self.frozen_backbone = load_backbone(backbone, dtype, trust_remote_code)[0].requires_grad_(False).eval()
        self.flow: ExplanationFlowModel | None = None  # built in bind(), once the backbone's width is known
        self.seed = run_seed(seed)
        self.generator = torch.Generator().manual_seed(self.seed)
        self._policy: list[nn.Module] = []  # the trainer's policy, held outside the module tree
        self.tokenizer = None

    # ------------------------------------------------------------------------------------------ binding
    def bind(self, backbone: nn.Module, layer_positions: Sequence[float], tokenizer=None) -> None:
        """Build φ at the backbone's width; the flow reads ``backbone`` with its LoRA adapters disabled unless a
        frozen ``backbone`` was given."""
        if self.frozen_backbone is None and not hasattr(backbone, "disable_adapter"):
            raise ConfigError("ExplanationReward reads the frozen policy through its LoRA adapters disabled: give the "
                              "policy a `lora`, or set ExplanationReward.backbone to a frozen copy")
        self._policy, self.tokenizer = [backbone], tokenizer
        flow_backbone = self.frozen_backbone or backbone
        with torch.random.fork_rng(devices=[]):  # φ's initialisation must not move the policy's sampling stream
            torch.manual_seed(self.seed)
            self.flow = ExplanationFlowModel(self.num_decisions, flow_backbone.config.hidden_size, **self.flow_options)

    @property
    def flow_backbone(self) -> nn.Module:
        return self.frozen_backbone if self.frozen_backbone is not None else self._policy[0]

    def _proxy_probs(self, contexts: list[str], explanations: list[str], decisions: list[list[str]]) -> Tensor:
        """[K_p, B, |A|] the proxies' softmax over the decisions after each explanation."""
        return proxy_probabilities(list(zip(self.proxies, self.proxy_tokenizers)), contexts, explanations, decisions,
                                   prompt_formats=self.proxy_formats)

    # ------------------------------------------------------------------------------------------ RL step
    def begin_step(self, step: int, batch: RolloutBatch) -> ExplanationStep:
        self._check_columns(batch)
        return ExplanationStep(self)

    @torch.no_grad()
    def token_rewards(self, micro: RolloutBatch, rows: Tensor, step: ExplanationStep) -> Tensor:
        """Token rewards: r(s^k) on sentence k's last token (eq. 5) and the sparse reward on the last token; the
        logged means accumulate on ``step``."""
        columns = micro.columns
        decisions = torch.tensor(columns["decision"], device=micro.input_ids.device)
        inputs = explanation_inputs(micro, self.tokenizer)
        proxy_full = self._proxy_probs(columns["context"], micro.responses, columns["decisions"])
        step.accumulate("train/explanation_accuracy", (proxy_full.argmax(-1) == decisions).float().mean(), len(rows))
        if self.reward == "proxy":
            probs, mask = self._proxy_prefix_probs(micro, inputs, decisions)
            sentence, _ = sentence_rewards_from_probs(probs, mask)
            full = probs[torch.arange(len(probs)), mask.sum(-1) - 1]
            correct = proxy_full.mean(0).argmax(-1) == decisions
            step.accumulate("train/reward_mean", full.mean(), len(rows))
        else:
            out = self.flow.sentence_rewards(self.flow_backbone, inputs, decisions, self.generator)
            sentence = out.rewards if self.reward == "flow" else torch.zeros_like(out.rewards)
            correct = out.predicted == decisions
            step.accumulate("train/reward_mean", out.true_logit_mean.mean(), len(rows))
            step.accumulate("train/reward_std", out.true_logit_std.mean(), len(rows))
        step.accumulate("train/flow_prediction_accuracy", correct.float().mean(), len(rows))
        return place_token_rewards(tuple(micro.input_ids.shape), inputs, sentence, correct.float() * self.sparse_reward)

    def _proxy_prefix_probs(self, micro: RolloutBatch, inputs: ExplanationInputs, decisions: Tensor):
        """Proxy baseline: mean over proxies of p(a* | x^g(k)) for k = 0..K (App. C, eq. 5), ``[B, K_max + 1]``."""
        contexts, reasonings, owners = [], [], []
        for b, ends in enumerate(inputs.sentence_ends):
            prompt = int(inputs.prompt_lengths[b])
            ids = inputs.input_ids[b]
            for end in [0, *ends]:
                contexts.append(micro.columns["context"][b])
                reasonings.append(self.tokenizer.decode(ids[prompt:prompt + end], skip_special_tokens=True))
                owners.append(b)
        decision_lists = [micro.columns["decisions"][b] for b in owners]
        # The proxies' forwards are collectives under ZeRO-3 and their number grows with the prefix count: every rank
        # scores as many prefixes as the rank with the most, repeating its last one.
        padding = all_reduce_int(len(owners), ReduceOp.MAX) - len(owners)
        probs = self._proxy_probs(contexts + contexts[-1:] * padding, reasonings + reasonings[-1:] * padding,
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

    def _check_columns(self, batch: RolloutBatch) -> None:
        missing = [key for key in ("context", "decisions", "decision") if key not in batch.columns]
        if missing:
            raise ConfigError(f"ExplanationReward needs the data columns context, decisions and decision (an "
                              f"ExplanationDataModule); missing: {', '.join(missing)}")
        widths = {len(d) for d in batch.columns["decisions"]}
        if widths != {self.num_decisions}:
            raise ConfigError(f"ExplanationReward.num_decisions is {self.num_decisions}, the data's records have "
                              f"{sorted(widths)} candidate decisions")

    # ------------------------------------------------------------------------------------------ rounds
    def fit_round(self, records: list[dict[str, Any]], generate: Callable[[list[str], int, float], RolloutBatch],
                  step: Callable[[Tensor], None], round_index: int, rank: int, world_size: int) -> dict[str, float]:
        """One round's flow phase (§3.2): explain this rank's share of the round's contexts
        (``explanations_per_context`` each at the sampling temperature), the proxies score every candidate, the
        accepted (explanation, proxy) pairs of every rank are gathered, and every rank fits φ on the union for
        ``flow_epochs_per_round`` epochs with the same batch order and noise (seed + round), so the flow's updates
        are identical on every rank and equal one rank's over all the contexts. ``step(loss)`` backpropagates and
        moves the flow. Returns the round's metrics."""
        rows = self._share(records[: self.round_contexts], "round_contexts", rank, world_size)
        n = self.explanations_per_context
        with torch.no_grad():
            batch = generate([r["prompt"] for r in rows], n, None)
            repeated = [r for r in rows for _ in range(n)]
            probs = self._proxy_probs([r["context"] for r in repeated], batch.responses, [r["decisions"] for r in repeated])
            decisions = torch.tensor([r["decision"] for r in repeated], device=probs.device)
            kept = rejection_mask(probs, decisions)
        metrics = {"round/acceptance": float(kept.float().mean()), "round/index": float(round_index)}
        if self.reward == "proxy":
            return metrics
        # Explanation j of the round's context c is row c·n + j of the round, on whichever rank wrote it.
        contexts = torch.tensor(rank_share(range(len(records[: self.round_contexts])), rank, world_size))
        row_ids = (contexts[:, None] * n + torch.arange(n)).flatten()
        local = accepted_flow_data(self.flow, self.flow_backbone, explanation_inputs(batch, self.tokenizer), probs,
                                   kept, row_ids)
        data = gather_flow_data(local)
        generator = torch.Generator().manual_seed(self.seed + round_index)  # CPU: the same draws on any device
        losses = fit_flow(self.flow, data, self.flow_epochs_per_round, self.flow_batch_size, generator, step)
        metrics["round/flow_pairs"] = float(len(data.pairs()[0]))
        metrics["round/flow_loss"] = (float(torch.stack(losses[-max(1, len(losses) // 10):]).mean()) if losses
                                      else float("nan"))
        return metrics

    def heldout(self, records: list[dict[str, Any]], rank: int, world_size: int) -> list[dict[str, Any]]:
        """This rank's share of the held-out contexts a round's evaluation uses."""
        return self._share(records[: self.heldout_contexts], "heldout_contexts", rank, world_size)

    @staticmethod
    def _share(rows: list, option: str, rank: int, world_size: int) -> list:
        if 0 < len(rows) < world_size:
            raise ValueError(f"ExplanationReward.{option} gives {len(rows)} contexts for {world_size} ranks; every rank "
                             "needs at least one")
        return rank_share(rows, rank, world_size)

    # ------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, rows: dict[str, list], generate: Callable[[list[str], int, float], RolloutBatch]
                 ) -> dict[str, tuple[float, float]]:
        """One explanation per row at ``eval_temperature``, judged by the evaluators (the proxies when there are
        none) and the judge: explanation accuracy; with a flow, its accuracy on positives / negatives (the first
        judge right / wrong) and its reward (mean z1[a*] over draws) mean and std. Returns ``name: (value, weight)``,
        to be averaged over batches by weight."""
        batch = generate(rows["prompt"], 1, self.eval_temperature)
        decisions = torch.tensor(rows["decision"], device=batch.input_ids.device)
        judges = [*self.evaluators, *self.judges] or [LogitEvaluator(m, t, self.prompt_format)
                                                      for m, t in zip(self.proxies, self.proxy_tokenizers)]
        effective = explanation_accuracy(judges, rows["context"], batch.responses, rows["decisions"], decisions)
        out = {"explanation_accuracy": (float(effective.mean()), float(len(decisions)))}
        if self.reward == "proxy":
            return out
        inputs = explanation_inputs(batch, self.tokenizer)
        context = self.flow.encode(self.flow_backbone, inputs.input_ids, inputs.attention_mask)
        draws = self.flow.predict_draws(context, self.generator)  # [B, M, |A|]
        true = draws.gather(-1, decisions[:, None, None].expand(-1, draws.shape[1], 1)).squeeze(-1)
        out["reward_mean"] = (float(true.mean()), float(len(decisions)))
        out["reward_std"] = (float(true.std(-1).mean()), float(len(decisions)))
        predicted = draws.mean(1).argmax(-1)
        first_judge = explanation_accuracy(judges[:1], rows["context"], batch.responses, rows["decisions"], decisions)
        for kind, mask in (("positive", first_judge > 0), ("negative", first_judge == 0)):
            count = float(mask.sum())
            right = float((predicted[mask] == decisions[mask]).float().sum()) if count else 0.0
            out[f"flow_accuracy_{kind}"] = (right / count if count else 0.0, count)
        return out


class ExplanationStep:
    """The step scorer of :class:`ExplanationReward`: the step's token rewards and the row-weighted means it logs
    (explanation and flow-prediction accuracy, reward mean / std)."""

    def __init__(self, reward: ExplanationReward):
        self.reward = reward
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def score(self, micro: RolloutBatch, rows: Tensor) -> Tensor:
        return self.reward.token_rewards(micro, rows, self)

    def accumulate(self, name: str, value: Tensor, weight: int) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value) * weight
        self.counts[name] = self.counts.get(name, 0.0) + weight

    def metrics(self) -> dict[str, float]:
        return {name: self.sums[name] / self.counts[name] for name in self.sums}
