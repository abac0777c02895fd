from flowkit.explain.tokenizer import word_tokenizer
from flowkit.llm.backbone import load_backbone
from flowkit.llm.tiny import tiny_qwen2

TEXTS = ["Given d=+3,-2 a=east; d=+1,-1 a=?. Please analyze.", "goal is 1 east, 2 north. dist is 1.4.", "north"]


def test_word_pieces_keep_signed_numbers_and_decimals_whole():
    tokenizer = word_tokenizer(TEXTS)
    pieces = tokenizer.convert_ids_to_tokens(tokenizer("d=+3,-2 dist is 1.4.")["input_ids"])
    assert pieces == ["<bos>", "d", "=", "+3", ",", "-2", "dist", "is", "1.4", "."]
    ids = tokenizer("goal is 1 east, 2 north. dist is 1.4.", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "goal is 1 east, 2 north. dist is 1.4."
    assert tokenizer.convert_ids_to_tokens(tokenizer("zebra")["input_ids"])[-1] == "<unk>"


def test_saved_word_tokenizer_loads_back_unchanged_next_to_a_qwen2_model(tmp_path):
    tokenizer = word_tokenizer(TEXTS)
    tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
               intermediate_size=32).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    _, loaded = load_backbone(str(tmp_path))
    text = "goal is 1 east, 2 north. dist is 1.4."
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text
    assert loaded.padding_side == "left" and loaded.pad_token == "<pad>"
