"""What ``make_tiny_tool_adder.py`` and ``make_tiny_guesser.py`` share: build a bundled tiny agent for an episode task
by SFT on an expert's episodes, stopped where its success leaves RL room, and measure it.

Steps: build the character tokenizer with its chat template (``flowkit.llm.tiny.chat_char_tokenizer``, printable
ASCII) and a randomly initialised tiny Qwen2 of the adder's shape; let the expert play the train records through
the real episode runner (``flowkit.agents.imitation``: the traces are the ids RL will see, the loss on the policy's
tokens only); SFT (AdamW, batch ``--batch-size``) and, every ``--eval-every`` steps once greedy play wins some
validation episode, sample the policy at temperature 1 on ``--eval-records`` validation records through the runner
and the ``hf`` engine (``flowkit.agents.evaluate``), as RL samples it; stop at the first check whose success rate
lies in ``--band``. Then save model, tokenizer and generation config, measure on the test records (greedy, and
``--test-samples`` episodes per record at temperature 1) and write the model card.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GenerationConfig

from flowkit.agents.evaluate import EPISODE_TASKS, episode_success
from flowkit.agents.imitation import Messages, expert_trajectories, imitate_until, imitation_tensors
from flowkit.llm.backbone import ASSETS, load_backbone
from flowkit.llm.tiny import chat_char_tokenizer, parse_chat, tiny_qwen2

PRINTABLE = [chr(code) for code in range(32, 127)]  # the environments' messages are English: no <unk> in them


def arguments(description: str, band: tuple[float, float], lr: float, eval_every: int) -> argparse.Namespace:
    """The scripts' options; the defaults given here are the ones each bundled model was made with."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--measure", action="store_true", help="only re-measure the bundled policy (no building)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--eval-every", type=int, default=eval_every)
    parser.add_argument("--eval-records", type=int, default=100, help="validation records per check")
    parser.add_argument("--eval-samples", type=int, default=4, help="episodes per validation record per check")
    parser.add_argument("--band", type=float, nargs=2, default=band,
                        help="stop at the first check whose validation success rate (T=1) is in [low, high]")
    parser.add_argument("--test-records", type=int, default=200)
    parser.add_argument("--test-samples", type=int, default=4)
    return parser.parse_args()


def measure(model, tokenizer, environment: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Greedy and temperature-1 episode metrics on the first ``--test-records`` test records."""
    task = EPISODE_TASKS[environment]
    records = task.records("test")[:args.test_records]
    rows = {"greedy": episode_success(model, tokenizer, task, records, 1, 0.0, args.seed),
            "sampled": episode_success(model, tokenizer, task, records, args.test_samples, 1.0, args.seed)}
    print(json.dumps(rows, indent=1), flush=True)
    return rows


def warm_start(model, tokenizer, source: str) -> None:
    """Copy the bundled model ``source`` (the same shape) into ``model``, its embedding rows by token: the characters
    both vocabularies hold keep what ``source`` learned about them; the others keep their random initialisation."""
    donor, donor_tokenizer = load_backbone(f"bundled:{source}")
    donated = dict(donor.named_parameters())
    vocab = tokenizer.get_vocab()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name == "model.embed_tokens.weight":  # tied: the output head's rows move with it
                for token, donor_id in donor_tokenizer.get_vocab().items():
                    parameter[vocab[token]] = donated[name][donor_id]
            else:
                parameter.copy_(donated[name])


def make(name: str, environment: str, respond: Callable[[Messages], str], args: argparse.Namespace,
         model_card: str, init_from: str | None = None) -> None:
    """Build (or with ``--measure`` only re-measure) ``flowkit/assets/<name>`` for ``environment``'s task, from
    random weights or, with ``init_from``, from that bundled model's (:func:`warm_start`)."""
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    # one thread: the ~1 M-parameter model gains nothing from more, and it fixes the reduction order
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out, task = ASSETS / name, EPISODE_TASKS[environment]
    if args.measure:
        model, tokenizer = load_backbone(str(out))
        measure(model, tokenizer, environment, args)
        return
    tokenizer = chat_char_tokenizer(PRINTABLE)
    model = tiny_qwen2(len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    if init_from is not None:
        warm_start(model, tokenizer, init_from)
    train = expert_trajectories(tokenizer, respond, parse_chat, task.options, task.records("train"))
    val = task.records("val")[:args.eval_records]

    def success() -> float:
        # the sampled check (``--eval-samples`` times the cost) only once greedy play wins some validation episode
        if not episode_success(model, tokenizer, task, val, 1, 0.0, args.seed)["episodes/success_rate"]:
            return 0.0
        return episode_success(model, tokenizer, task, val, args.eval_samples, 1.0, args.seed)["episodes/success_rate"]

    steps, val_success = imitate_until(model, imitation_tensors(train, tokenizer.pad_token_id), success,
                                       tuple(args.band), args.lr, args.batch_size, args.max_steps, args.eval_every,
                                       args.seed)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=task.turn_tokens)
    model.save_pretrained(out, safe_serialization=True)  # before the long measurement: --measure can redo it
    tokenizer.save_pretrained(out)
    rows = measure(model.eval(), tokenizer, environment, args)
    (out / "README.md").write_text(model_card.format(
        n_params=sum(p.numel() for p in model.parameters()), seed=args.seed, steps=steps, lr=args.lr,
        batch=args.batch_size, n_train=len(train), train_tokens=sum(len(t.token_ids) for t in train) // len(train),
        eval_every=args.eval_every, eval_records=args.eval_records, eval_samples=args.eval_samples,
        low=args.band[0], high=args.band[1], val=val_success, records=args.test_records, n=args.test_samples,
        options=task.options, turn_tokens=task.turn_tokens, table=table(rows, args.test_samples)))


def table(rows: dict[str, dict[str, float]], samples: int) -> str:
    """The model card's rows: greedy, temperature 1 (pass@1 and pass@n), turns, tool errors, truncations."""
    greedy, sampled = rows["greedy"], rows["sampled"]
    return "\n".join(f"| {label} | {value:.3f} |" for label, value in [
        ("success, greedy", greedy["episodes/success_rate"]),
        ("success (pass@1), temperature 1", sampled["episodes/success_rate"]),
        (f"pass@{samples}, temperature 1", sampled[f"episodes/pass@{samples}"]),
        ("policy turns per episode, temperature 1", sampled["episodes/turns_mean"]),
        ("tool-call error rate, temperature 1", sampled["episodes/tool_error_rate"]),
        ("episodes truncated (turns or tokens), temperature 1", sampled["episodes/truncated_rate"]),
    ])
