"""Build ``flowkit/assets/tiny_chat`` (the bundled tiny_adder with a chat template) and
``flowkit/assets/arithmetic_chat`` (the arithmetic task as conversational records), so ``prompt_format: chat``
runs offline::

    python scripts/make_tiny_chat.py

The model is tiny_adder unchanged: its weights are a link to ``../tiny_adder/model.safetensors`` and its tokenizer
is the same character-level one, with a ``chat_template`` added to ``tokenizer_config.json``. The template renders
``<bos>`` + the user and assistant turns' text (each assistant turn ended by ``<eos>``) and drops system turns:
the model knows only digits, ``+ = ,`` and ``\\boxed{}``, and was trained on ``<bos>47+38=``, which a one-turn
conversation renders to. The data are the first 1000 train and 200 val records of ``flowkit/assets/arithmetic``,
each prompt a system message (as TRL's conversational datasets have) and the user's sum.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "flowkit" / "assets"
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                 "{% if message['role'] == 'user' %}{{ message['content'] }}"
                 "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}{% endif %}"
                 "{% endfor %}")
SYSTEM = "Put the final answer in \\boxed{}."
SPLITS = {"train": 1000, "val": 200}


def make_model(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        shutil.copyfile(source / name, target / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    weights = target / "model.safetensors"
    if weights.is_symlink() or weights.exists():
        weights.unlink()
    os.symlink(os.path.join("..", source.name, "model.safetensors"), weights)
    (target / "README.md").write_text(
        "# tiny_chat\n\nThe bundled `tiny_adder` (same weights: `model.safetensors` links to `../tiny_adder`, same "
        "tokenizer) with a chat template in `tokenizer_config.json`, for `prompt_format: chat` offline. The template "
        "renders `<bos>` + the user and assistant turns (assistant turns end with `<eos>`) and drops system turns, "
        "which the character-level vocabulary cannot spell. Made by `python scripts/make_tiny_chat.py`; the "
        "conversational data are in `flowkit/assets/arithmetic_chat/`.\n")


def make_data(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for split, count in SPLITS.items():
        lines = (source / f"{split}.jsonl").read_text().splitlines()[:count]
        with open(target / f"{split}.jsonl", "w") as out:
            for line in lines:
                record = json.loads(line)
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": record["prompt"]}]
                out.write(json.dumps({**record, "prompt": messages}) + "\n")


def main() -> None:
    make_model(ASSETS / "tiny_adder", ASSETS / "tiny_chat")
    make_data(ASSETS / "arithmetic", ASSETS / "arithmetic_chat")
    print(f"wrote {ASSETS / 'tiny_chat'} and {ASSETS / 'arithmetic_chat'}")


if __name__ == "__main__":
    main()
