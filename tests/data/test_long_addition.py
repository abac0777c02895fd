import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from flowkit.data import arithmetic
from flowkit.data.grader import extract_boxed, grade
from flowkit.data.long_addition import (
    ALPHABET,
    DEFAULT_OPERANDS,
    OPERAND_COUNTS,
    SPLIT_SIZES,
    generate_splits,
    make_example,
    max_new_tokens,
    max_solution_length,
    write_splits,
)
from flowkit.llm.backbone import ASSETS, load_backbone
from flowkit.llm.hf_engine import HFRolloutEngine
from flowkit.llm.packing import encode_pairs
from flowkit.llm.sft import completion_tensors

ROOT = Path(__file__).resolve().parent.parent.parent
CONFIGS, SCRIPTS = ROOT / "configs", ROOT / "scripts"
STEP = re.compile(r"(\d(?:\+\d)+)=(\d+)")


@pytest.mark.parametrize("operands, solution", [
    ((347, 281, 905), "7+1+5=13,4+8+0+1=13,3+2+9+1=15\\boxed{1533}"),  # the module docstring's example
    ((100, 200, 300), "0+0+0=0,0+0+0=0,1+2+3=6\\boxed{600}"),          # no carry at all
    ((999, 999, 999, 999), "9+9+9+9=36,9+9+9+9+3=39,9+9+9+9+3=39\\boxed{3996}"),  # carry 3, the longest k = 4
    ((555, 445), "5+5=10,5+4+1=10,5+4+1=10\\boxed{1000}"),             # a carry out of the top column
])
def test_make_example_by_hand(operands, solution):
    assert make_example(operands) == {"prompt": "+".join(map(str, operands)) + "=", "solution": solution,
                                      "answer": str(sum(operands))}


def test_two_two_digit_operands_are_the_adders_layout():
    for a, b in [(47, 38), (41, 32), (87, 38), (99, 99), (10, 10)]:
        assert make_example((a, b)) == arithmetic.make_example(a, b)


@pytest.mark.parametrize("bad", [(123,), (123, 45), (123, -456)])  # one operand, unequal lengths, negative
def test_make_example_rejects_bad_operands(bad):
    with pytest.raises(ValueError, match="operands"):
        make_example(bad)


@pytest.mark.parametrize("k", OPERAND_COUNTS)
def test_every_solution_is_arithmetically_consistent(k):
    for ex in sum(generate_splits(k, seed=0).values(), []):
        operands = ex["prompt"].removesuffix("=").split("+")
        assert len(operands) == k and all(len(o) == 3 and o[0] != "0" for o in operands)
        body, boxed = ex["solution"].split("\\boxed{")
        steps = body.split(",")
        assert len(steps) == 3
        carry = 0
        for column, step in zip((2, 1, 0), steps):
            terms, total = STEP.fullmatch(step).groups()
            digits = [int(d) for d in terms.split("+")]
            assert digits == [int(o[column]) for o in operands] + ([carry] if carry else [])
            assert int(total) == sum(digits)
            carry = int(total) // 10
        assert boxed == ex["answer"] + "}" and extract_boxed(ex["solution"]) == ex["answer"]
        assert int(ex["answer"]) == sum(map(int, operands))
        assert set(ex["prompt"] + ex["solution"]) <= set(ALPHABET)
        assert len(ex["solution"]) <= max_solution_length(k)


def test_splits_are_disjoint_sized_and_depend_on_seed():
    splits = generate_splits(3, seed=0)
    assert {name: len(rows) for name, rows in splits.items()} == SPLIT_SIZES
    prompts = {name: {ex["prompt"] for ex in rows} for name, rows in splits.items()}
    assert sum(map(len, prompts.values())) == len(set().union(*prompts.values()))  # distinct within and across
    assert generate_splits(3, seed=0) == splits
    assert generate_splits(3, seed=1)["test"] != splits["test"]
    assert generate_splits(2, seed=0)["test"][0]["prompt"].count("+") == 1


def test_write_splits_round_trips(tmp_path):
    paths = write_splits(tmp_path, seed=3, operand_counts=(2,))
    for name, path in paths[2].items():
        assert path == tmp_path / "k2" / f"{name}.jsonl"
        assert [json.loads(line) for line in path.read_text().splitlines()] == generate_splits(2, seed=3)[name]


def test_committed_splits_match_the_generator():
    for k in OPERAND_COUNTS:
        for name, examples in generate_splits(k, seed=0).items():
            lines = (ASSETS / "long_addition" / f"k{k}" / f"{name}.jsonl").read_text().splitlines()
            assert [json.loads(line) for line in lines] == examples


@pytest.mark.parametrize("config", ["rlfr_sparse.yaml", "grpo_sparse.yaml"])
def test_configs_generate_enough_tokens_for_the_default_difficulty(config):
    init = yaml.safe_load((CONFIGS / config).read_text())["model"]["init_args"]
    assert init["sampling"]["max_new_tokens"] == max_new_tokens(DEFAULT_OPERANDS) == max_solution_length(DEFAULT_OPERANDS) + 7
    assert init["backbone"] == "bundled:long_adder"


@pytest.fixture(scope="module")
def long_adder():
    return load_backbone("bundled:long_adder")


def test_bundled_policy_shares_the_adders_token_layout(long_adder):
    _, tokenizer = long_adder
    ex = make_example((347, 281, 905))
    input_ids, _, labels = completion_tensors(tokenizer, [(ex["prompt"], ex["solution"])])
    ids = input_ids[0].tolist()
    prompt_len = 1 + len(ex["prompt"])  # <bos> + one token per character
    assert tokenizer.decode(ids) == "<bos>" + ex["prompt"] + ex["solution"] + "<eos>"
    assert (labels[0, :prompt_len] == -100).all() and labels[0, prompt_len:].tolist() == ids[prompt_len:]
    assert encode_pairs(tokenizer, [ex["prompt"]], [ex["solution"]]).input_ids[0].tolist() == ids
    assert tokenizer.get_vocab() == load_backbone("bundled:tiny_adder")[1].get_vocab()


def test_bundled_policy_is_sparse_but_not_blind(long_adder):
    """The task's point (issue 25): at the default difficulty most groups of 8 samples (T = 1) are all wrong, yet
    some samples are right, so RL has signal to find."""
    model, tokenizer = long_adder
    assert sum(f.stat().st_size for f in (ASSETS / "long_adder").iterdir()) < 5_000_000
    test = generate_splits(DEFAULT_OPERANDS, seed=0)["test"][:48]
    torch.manual_seed(0)
    engine = HFRolloutEngine(model, tokenizer, max_new_tokens=max_new_tokens(DEFAULT_OPERANDS), temperature=1.0)
    batch = engine.generate([ex["prompt"] for ex in test], 8, [ex["answer"] for ex in test])
    hits = torch.tensor([grade(r, a) for r, a in zip(batch.responses, batch.answers)]).view(len(test), 8)
    assert 0 < hits.float().mean() <= 0.15
    assert (~hits.any(1)).float().mean() >= 0.5


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pass_at_k_is_the_unbiased_estimator_by_hand():
    pass_at_k = _script("make_long_adder").pass_at_k
    hits = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert pass_at_k(hits, 1) == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    # prompt 0: 1 − C(3,2)/C(4,2) = 1/2; prompt 2: 1 − C(1,2)/C(4,2) = 1
    assert pass_at_k(hits, 2) == pytest.approx((0.5 + 0 + 1) / 3)
    assert pass_at_k(hits, 4) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="pass@5"):
        pass_at_k(hits, 5)


def test_study_scores_the_first_wrong_token_against_correct_samples_at_that_position():
    study = _script("rlfr_sparse_study")
    # three responses to one prompt (column 0), scored at columns 1-3 (two characters and <eos>)
    deviation = torch.tensor([[0.0, 0.1, 0.2, 0.3],     # "12": correct
                              [0.0, 0.1, 0.5, 0.3],     # "13": first wrong at position 1 → 0.5 vs 0.2
                              [0.0, 0.05, 0.2, 0.3]])   # "92": first wrong at position 0 → 0.05 vs 0.1
    scores = {"deviation": deviation, "reward": -deviation, "surprisal": 2 * deviation, "start": torch.tensor([1, 1, 1])}
    result = study.first_wrong_aurocs(scores, ["12", "13", "92"], ["12"] * 3, torch.tensor([True, False, False]))
    # pooled as the benchmark pools: positives {0.5, 0.05} against negatives {0.2, 0.1} → 2 of 4 pairs
    assert result == {"deviation": 0.5, "reward": 0.5, "surprisal": 0.5}
    scores["deviation"] = torch.tensor([[0.0, 0.1, 0.2, 0.3], [0.0, 0.1, 0.5, 0.3], [0.0, 0.9, 0.2, 0.3]])
    assert study.first_wrong_aurocs(scores, ["12", "13", "92"], ["12"] * 3,
                                    torch.tensor([True, False, False]))["deviation"] == 1.0


def test_study_table_pairs_each_seed_with_its_grpo_run():
    study = _script("rlfr_sparse_study")

    def run(arm, seed, final_pass1):
        evals = [{"step": 0, "pass@1": 0.04, "pass@16": 0.3, "all_wrong": 0.8, "greedy": 0.05},
                 {"step": 300, "pass@1": final_pass1, "pass@16": 0.5, "all_wrong": 0.6, "greedy": 0.1}]
        return {"arm": arm, "seed": seed, "evals": evals, "train_accuracy": [0.0]}

    runs = [run("grpo", 0, 0.10), run("grpo", 1, 0.20), run("rlfr", 0, 0.16), run("rlfr", 1, 0.24)]
    table = study.paired_table(runs, ["grpo", "rlfr"], samples=16)
    rlfr = next(line for line in table.splitlines() if line.startswith("| rlfr "))
    # differences 0.06 and 0.04: mean 0.05, SE = sd / √2 = 0.01414 / 1.414 = 0.010
    assert rlfr.startswith("| rlfr | 2 | 0.200 | +0.050 ± 0.010 | 0.500 | +0.000 ± 0.000 |")
    assert rlfr.endswith("| – | 2/2 |"), rlfr  # no flow AUROC in these rows; both seeds above their GRPO run
