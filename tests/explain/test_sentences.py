from flowkit.explain.sentences import sentence_spans, split_sentences


def test_plain_sentences_and_trailing_fragment():
    assert split_sentences("Goal is east. It moves! Why? because") == ["Goal is east.", "It moves!", "Why?", "because"]


def test_decimals_do_not_split():
    assert split_sentences("The value is 3.5 today. dist is 1.4. it moved.") == [
        "The value is 3.5 today.", "dist is 1.4.", "it moved."]


def test_abbreviations_do_not_split():
    text = "See e.g. the map, i.e. the grid. Dr. Smith agrees etc. and more. Fig. 2 shows it."
    assert split_sentences(text) == ["See e.g. the map, i.e. the grid.", "Dr. Smith agrees etc. and more.",
                                     "Fig. 2 shows it."]


def test_single_capital_letter_ends_a_sentence():
    assert split_sentences("The answer is B. Next step.") == ["The answer is B.", "Next step."]


def test_newlines_end_sentences_and_blank_lines_vanish():
    assert split_sentences("first line\n\n- second item\nthird.  ") == ["first line", "- second item", "third."]


def test_closing_quotes_and_brackets_stay_with_their_sentence():
    assert split_sentences('He said "go." (Really.) Ok') == ['He said "go."', "(Really.)", "Ok"]


def test_spans_index_the_original_text_and_empty_text_has_none():
    text = "  a b.   c d.\n"
    spans = sentence_spans(text)
    assert [text[a:b] for a, b in spans] == ["a b.", "c d."]
    assert spans[0][0] == 2
    assert sentence_spans("") == [] and sentence_spans(" \n ") == []
