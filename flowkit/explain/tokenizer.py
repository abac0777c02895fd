"""A word-level tokenizer for the bundled toy task: one token per word, signed number (``+3``, ``1.4``) or
punctuation mark, so tiny-model sequences stay short (the paper's prompts are long in characters)."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

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
