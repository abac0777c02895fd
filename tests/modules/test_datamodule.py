import json

import pytest

from flowkit.data.records import RecordError
from flowkit.errors import ConfigError
from flowkit.modules.datamodule import PromptStream, RolloutDataModule, collate_records


def test_prompt_stream_is_a_function_of_seed_and_index():
    records = [{"prompt": str(i), "answer": str(i)} for i in range(10)]
    stream = PromptStream(records, batch_size=4, seed=3)
    first = [b["prompt"] for _, b in zip(range(5), iter(stream))]
    # two batches per epoch: epoch 0 is a permutation prefix, and resuming at index 3 replays batch 3
    assert len(set(first[0] + first[1])) == 8
    stream.start_index = 3
    assert next(iter(stream))["prompt"] == first[3]
    assert PromptStream(records, 4, seed=4).batch(0)["prompt"] != first[0]


def test_prompt_stream_batches_do_not_depend_on_the_order_they_are_drawn_in():
    """Each epoch's permutation is kept between batches: jumping across epochs and back draws what a fresh stream does."""
    records = [{"prompt": str(i), "answer": str(i)} for i in range(10)]
    stream = PromptStream(records, batch_size=4, seed=3)
    for index in (5, 0, 1, 4, 2, 0, 7):
        assert stream.batch(index)["prompt"] == PromptStream(records, 4, seed=3).batch(index)["prompt"]
    epochs = [set(stream.batch(2 * e)["prompt"] + stream.batch(2 * e + 1)["prompt"]) for e in range(3)]
    assert all(len(e) == 8 for e in epochs) and len({frozenset(e) for e in epochs}) > 1


def test_eval_sets_accept_problem_field_and_template():
    data = RolloutDataModule(val_path=None, eval_paths={"math500": "bundled:math_eval/math500.jsonl"},
                             prompt_template="Q: {prompt}\nA:", max_val_examples=5)
    data.setup("validate")
    rows = data.val_sets["math500"]
    assert len(rows) == 5 and rows[0]["prompt"].startswith("Q: ") and rows[0]["prompt"].endswith("\nA:")
    assert "\\boxed" not in rows[0]["prompt"] and rows[0]["answer"]


def test_bad_training_file_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n{not json\n")
    with pytest.raises(RecordError, match=r"train.jsonl:2: malformed JSON"):
        RolloutDataModule(train_path=str(path), val_path=None).setup("fit")


def test_batch_size_is_prompts_per_step_across_all_ranks():
    """``batch_size`` 8 on 2 ranks: each rank draws 4 prompts and together they cover the 8 of one global batch."""
    from types import SimpleNamespace

    from flowkit.errors import ConfigError

    data = RolloutDataModule(batch_size=8, val_path=None)
    data.setup("fit")
    firsts = []
    for rank in (0, 1):
        data.trainer = SimpleNamespace(global_rank=rank, world_size=2, max_steps=1)
        firsts.append(next(iter(data.train_dataloader())))
    assert [len(batch["prompt"]) for batch in firsts] == [4, 4]
    assert not set(firsts[0]["prompt"]) & set(firsts[1]["prompt"])
    data.trainer = SimpleNamespace(global_rank=0, world_size=3, max_steps=1)
    with pytest.raises(ConfigError, match=r"batch_size \(8, prompts per step across all ranks\) must be divisible by the number of ranks \(3\)"):
        data.train_dataloader()


def test_batches_of_records_with_and_without_a_solution_leave_the_solution_out():
    records = [{"prompt": "1", "answer": "1", "solution": "s"}, {"prompt": "2", "answer": "2"}]
    assert collate_records(records) == {"prompt": ["1", "2"], "answer": ["1", "2"]}
    assert collate_records(records[:1]) == {"prompt": ["1"], "answer": ["1"], "solution": ["s"]}


@pytest.mark.parametrize("template", [None, "Solve this."])
def test_a_prompt_template_without_the_prompt_is_refused(template):
    with pytest.raises(ConfigError, match=r"RolloutDataModule.prompt_template must be a string holding \{prompt\}"):
        RolloutDataModule(prompt_format="text", prompt_template=template)


def test_a_run_without_max_steps_on_the_endless_prompt_stream_is_a_config_error():
    import lightning as L

    data = RolloutDataModule(batch_size=4, val_path=None)
    data.trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False)
    data.setup("fit")
    with pytest.raises(ConfigError, match="set trainer.max_steps"):
        data.train_dataloader()
    data.trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False)
    assert next(iter(data.train_dataloader()))["index"] == 0


def test_record_fields_reach_each_row_and_every_record_must_have_them(tmp_path):
    path = tmp_path / "games.jsonl"
    path.write_text('{"prompt": "p", "answer": "3", "secret": 3, "low": 1}\n{"prompt": "q", "answer": "5", "secret": 5}\n')
    data = RolloutDataModule(train_path=str(path), val_path=None, batch_size=1, record_fields=["secret"])
    data.setup("fit")
    assert [row["secret"] for row in data.train_records] == [3, 5]
    with pytest.raises(RecordError, match=r"games.jsonl:2: .*'low'"):
        RolloutDataModule(train_path=str(path), val_path=None, record_fields=["secret", "low"]).setup("fit")
    with pytest.raises(ConfigError, match=r"^RolloutDataModule.record_fields cannot name 'answer', 'index': the row "
                                          r"holds it already"):
        RolloutDataModule(record_fields=["secret", "answer", "index"])
