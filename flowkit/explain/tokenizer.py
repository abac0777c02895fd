"""A word-level tokenizer for the bundled toy task: one token per word, signed number (``+3``, ``1.4``) or
punctuation mark, so tiny-model sequences stay short (the paper's prompts are long in characters)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from flowkit.llm.backbone import load_backbone, resolve_backbone_path

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
_PIECES = Regex(r"[+-]?\d+(?:\.\d+)?|[A-Za-z]+|[^A-Za-z\d\s]")


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                    pre_tokenizers.Split(_PIECES, behavior="isolated")])


def word_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """WordLevel tokenizer over every piece of ``texts``, ``<bos>`` prepended, left padding for generation.

    Decoding joins pieces with spaces and removes the space before ``.``, ``,``, ``?`` and ``!``, so
    sentences decode as they were written (``d=+3,+2`` decodes as ``d = +3, +2``).
    """
    splitter = _pre_tokenizer()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for text in texts:
        for piece, _ in splitter.pre_tokenize_str(text):
            vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = splitter
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left")


def load_model_and_tokenizer(name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False):
    """:func:`flowkit.llm.backbone.load_backbone`, but a tokenizer saved as a plain ``TokenizersBackend``
    (like :func:`word_tokenizer`) is loaded as saved: ``AutoTokenizer`` would swap in the architecture's
    own class (``Qwen2Tokenizer``), whose byte-level pipeline does not match the saved word-level one."""
    model, tokenizer = load_backbone(name_or_path, dtype, trust_remote_code)
    config = Path(resolve_backbone_path(name_or_path)) / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") == "TokenizersBackend":
        tokenizer = TokenizersBackend.from_pretrained(config.parent)
    return model, tokenizer
