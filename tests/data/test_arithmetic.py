import json
import re
from pathlib import Path

import pytest
import torch

from flowkit.data.arithmetic import (
    ALPHABET,
    generate_splits,
    make_example,
    write_splits,
)
from flowkit.data.grader import extract_boxed
from flowkit.llm.backbone import ASSETS, load_backbone
from flowkit.llm.packing import encode_pairs
from flowkit.llm.sft import completion_tensors

STEPS = re.compile(r"(\d)\+(\d)=(\d+),(\d)\+(\d)(\+1)?=(\d+)\\boxed\{(\d+)\}")


@pytest.mark.parametrize("a, b, solution", [
    (47, 38, "7+8=15,4+3+1=8\\boxed{85}"),   # carry, two-digit result
    (41, 32, "1+2=3,4+3=7\\boxed{73}"),      # no carry
    (87, 38, "7+8=15,8+3+1=12\\boxed{125}"),  # carry, three-digit result
    (60, 50, "0+0=0,6+5=11\\boxed{110}"),    # no carry, three-digit result
    (99, 99, "9+9=18,9+9+1=19\\boxed{198}"),  # longest solution
])
def test_make_example_layout(a, b, solution):
    assert make_example(a, b) == {"prompt": f"{a}+{b}=", "solution": solution, "answer": str(a + b)}


def test_every_solution_is_arithmetically_consistent():
    for ex in sum(generate_splits(seed=0).values(), []):
        a, b = map(int, ex["prompt"].removesuffix("=").split("+"))
        m = STEPS.fullmatch(ex["solution"])
        assert m, ex
        u1, u2, units, t1, t2, plus_one, tens, boxed = m.groups()
        assert (int(u1), int(u2), int(t1), int(t2)) == (a % 10, b % 10, a // 10, b // 10)
        assert int(units) == int(u1) + int(u2)
        assert bool(plus_one) == (int(units) >= 10)
        assert int(tens) == int(t1) + int(t2) + bool(plus_one)
        assert boxed == ex["answer"] == str(a + b) == extract_boxed(ex["solution"])
        assert set(ex["prompt"] + ex["solution"]) <= set(ALPHABET)


def test_make_example_rejects_non_two_digit_operands():
    with pytest.raises(ValueError, match="two-digit"):
        make_example(5, 38)


def test_splits_are_disjoint_cover_all_pairs_and_depend_on_seed():
    splits = generate_splits(seed=0)
    assert {k: len(v) for k, v in splits.items()} == {"test": 500, "val": 500, "train": 7100}
    prompts = {name: {ex["prompt"] for ex in exs} for name, exs in splits.items()}
    assert not (prompts["train"] & prompts["val"] or prompts["train"] & prompts["test"] or prompts["val"] & prompts["test"])
    assert len(set().union(*prompts.values())) == 90 * 90
    assert generate_splits(seed=0) == splits
    assert generate_splits(seed=1)["test"] != splits["test"]


def test_write_splits_round_trips(tmp_path):
    paths = write_splits(tmp_path, seed=3)
    expected = generate_splits(seed=3)
    for name, path in paths.items():
        assert path == tmp_path / f"{name}.jsonl"
        assert [json.loads(line) for line in path.read_text().splitlines()] == expected[name]


def test_committed_splits_match_the_generator():
    committed = ASSETS / "arithmetic"
    for name, examples in generate_splits(seed=0).items():
        lines = (committed / f"{name}.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == examples


@pytest.fixture(scope="module")
def tiny_adder():
    return load_backbone("bundled:tiny_adder")


def test_bundled_tokenizer_layout_is_shared_by_sft_and_rl(tiny_adder):
    _, tokenizer = tiny_adder
    ex = make_example(47, 38)
    input_ids, attention_mask, labels = completion_tensors(tokenizer, [(ex["prompt"], ex["solution"])])
    ids = input_ids[0].tolist()
    prompt_len = 1 + len(ex["prompt"])
    assert ids[:prompt_len] == tokenizer(ex["prompt"]).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids) == "<bos>" + ex["prompt"] + ex["solution"] + "<eos>"
    assert (labels[0, :prompt_len] == -100).all() and labels[0, prompt_len:].tolist() == ids[prompt_len:]
    rollout = encode_pairs(tokenizer, [ex["prompt"]], [ex["solution"]])
    assert rollout.input_ids[0].tolist() == ids and rollout.response_mask[0, prompt_len:].all()
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.padding_side == "left"


def test_bundled_policy_is_competent_but_imperfect(tiny_adder):
    """RL needs signal: greedy held-out accuracy well above 0 and below 1 (README "The bundled tiny task")."""
    model, tokenizer = tiny_adder
    assert sum(f.stat().st_size for f in Path(ASSETS / "tiny_adder").iterdir()) < 5_000_000
    test = generate_splits(seed=0)["test"][:100]
    enc = tokenizer([ex["prompt"] for ex in test], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    accuracy = sum(extract_boxed(t) == ex["answer"] for t, ex in zip(texts, test)) / len(test)
    assert 0.2 < accuracy < 0.9
