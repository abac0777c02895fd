"""Prompts through the policy tokenizer's chat template, conversational records, and `datasets.load_dataset` specs."""

import json
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from flowkit.data.records import RecordError, load_dataset_kwargs, load_records
from flowkit.errors import ConfigError
from flowkit.llm.backbone import ASSETS
from flowkit.llm.chat import format_prompt
from flowkit.modules.datamodule import PromptStream, RolloutDataModule

# A chat template in the style of instruct models; the second one writes the BOS token itself (as Llama 3's does).
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
TEMPLATE_WITH_BOS = "{{ bos_token }}" + TEMPLATE
CONVERSATION = [{"role": "system", "content": "Add."}, {"role": "user", "content": "47+38="}]


def tokenizer(template: str | None = TEMPLATE):
    tok = AutoTokenizer.from_pretrained(ASSETS / "tiny_adder")  # adds <bos> to every encoded text
    tok.chat_template = template
    return tok


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def datamodule(tmp_path, rows, tok, **options) -> RolloutDataModule:
    dm = RolloutDataModule(train_path=write_jsonl(tmp_path / "train.jsonl", rows), val_path=None, batch_size=2,
                           seed=0, **options)
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(tokenizer=tok))  # what Lightning attaches
    dm.setup("fit")
    return dm


def test_string_prompts_go_through_the_tokenizers_chat_template_by_default(tmp_path):
    tok = tokenizer()
    rows = [{"prompt": "47+38=", "answer": "85"}, {"prompt": "12+13=", "answer": "25"}]
    dm = datamodule(tmp_path, rows, tok, prompt_template="{prompt} Box the answer.")
    assert dm.tokenizer is tok  # taken from the module being trained
    expected = [tok.apply_chat_template([{"role": "user", "content": f"{r['prompt']} Box the answer."}],
                                        tokenize=False, add_generation_prompt=True) for r in rows]
    assert [r["prompt"] for r in dm.train_records] == expected
    assert expected[0] == "[user]47+38= Box the answer.\n[assistant]"


def test_conversational_jsonl_loads_and_renders_like_apply_chat_template(tmp_path):
    tok = tokenizer()
    rows = [{"prompt": CONVERSATION, "answer": "85"},
            {"prompt": [{"role": "user", "content": "12+13="}], "answer": "25"}]
    dm = datamodule(tmp_path, rows, tok)
    expected = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    assert [r["prompt"] for r in dm.train_records] == expected
    assert expected[0] == "[system]Add.\n[user]47+38=\n[assistant]"
    assert [r["answer"] for r in dm.train_records] == ["85", "25"]
    batch = PromptStream(dm.train_records, 2, seed=0).batch(0)  # what training_step receives
    assert sorted(batch["prompt"]) == sorted(expected)


def test_a_template_that_writes_bos_gives_the_token_ids_of_apply_chat_template():
    """The engine tokenizes prompts with the tokenizer's special tokens: the BOS the template writes is not doubled."""
    tok = tokenizer(TEMPLATE_WITH_BOS)
    text = format_prompt(CONVERSATION, tok, "chat")
    expected = tok.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=True)
    assert tok(text)["input_ids"] == expected["input_ids"]
    assert expected["input_ids"].count(tok.bos_token_id) == 1
    plain = tokenizer(TEMPLATE)  # without BOS in the template the text is exactly the template's
    assert format_prompt(CONVERSATION, plain, "chat") == plain.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)


def test_text_format_keeps_the_string_template(tmp_path):
    rows = [{"prompt": "47+38=", "answer": "85"}, {"prompt": "12+13=", "answer": "25"}]
    without_template = datamodule(tmp_path, rows, tokenizer(None), prompt_template="Q: {prompt}")
    assert [r["prompt"] for r in without_template.train_records] == ["Q: 47+38=", "Q: 12+13="]  # auto → text
    forced = datamodule(tmp_path, rows, tokenizer(), prompt_format="text", prompt_template="Q: {prompt}")
    assert [r["prompt"] for r in forced.train_records] == ["Q: 47+38=", "Q: 12+13="]


def test_format_mismatches_are_config_errors(tmp_path):
    conversation = [{"prompt": CONVERSATION, "answer": "85"}] * 2
    with pytest.raises(RecordError, match=r"train.jsonl:1: a conversational prompt needs prompt_format 'chat'"):
        datamodule(tmp_path, conversation, tokenizer(None))
    with pytest.raises(ConfigError, match="needs a tokenizer with a chat_template"):
        datamodule(tmp_path, [{"prompt": "1+1=", "answer": "2"}] * 2, tokenizer(None), prompt_format="chat")
    with pytest.raises(ConfigError, match="prompt_format must be one of auto, chat, text"):
        RolloutDataModule(prompt_format="jinja")


# ----------------------------------------------------------------------------- datasets.load_dataset


def test_load_dataset_spec_parses_into_keyword_arguments():
    assert load_dataset_kwargs("hf:openai/gsm8k?name=main&split=test") == {"path": "openai/gsm8k", "name": "main",
                                                                         "split": "test"}
    assert load_dataset_kwargs("hf:data/my_set") == {"path": "data/my_set", "split": "train"}
    for bad in ["hf:", "hf:x?split", "hf:x?path=y"]:
        with pytest.raises(RecordError):
            load_dataset_kwargs(bad)


def test_a_local_dataset_dir_loads_through_load_dataset(tmp_path):
    pytest.importorskip("datasets")
    data = tmp_path / "my_set"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(6)])
    write_jsonl(data / "test.jsonl", [{"prompt": "9+9=", "answer": "18"}])
    test = load_records(f"hf:{data}?split=test", ["prompt", "answer"])
    assert list(test) == [{"prompt": "9+9=", "answer": "18"}]
    assert len(load_records(f"hf:{data}?split=train[:4]", ["prompt"])) == 4  # split slicing works

    dm = RolloutDataModule(train_path=f"hf:{data}", val_path=None, eval_paths={"test": f"hf:{data}?split=test"},
                           batch_size=2)
    dm.setup("fit")
    assert sorted(r["prompt"] for r in dm.train_records) == sorted(f"{a}+1=" for a in range(6))
    assert dm.val_sets["test"] == [{"prompt": "9+9=", "answer": "18"}]
    with pytest.raises(RecordError, match=r"hf:.*\?split=validation: datasets.load_dataset failed"):
        load_records(f"hf:{data}?split=validation", ["prompt"])
