"""TextAssembler: reasoning/answer split, EOS, stop strings and what may be streamed."""

import pytest
from transformers import AutoTokenizer

from tandem.assets import ASSETS_DIR
from tandem.engine.output import GenerationStats, IncrementalDecoder, TextAssembler
from tandem.thinking import ThinkingMarkers, ThinkingTracker


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ASSETS_DIR / "tokenizer")


def _assembler(tokenizer, prompt_text="", stop=()):
    markers = ThinkingMarkers.from_tokenizer(tokenizer)
    tracker = ThinkingTracker(markers, tokenizer.encode(prompt_text, add_special_tokens=False))
    return TextAssembler(tokenizer, eos_token_ids={tokenizer.eos_token_id}, tracker=tracker, stop=list(stop))


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_reasoning_and_answer_are_split_at_the_markers_which_are_dropped(tokenizer):
    text = _assembler(tokenizer, prompt_text="<think>\n")
    consumed = text.add(_ids(tokenizer, 'the city is Paris</think>{"city": "Paris"}'))
    assert consumed == len(_ids(tokenizer, 'the city is Paris</think>{"city": "Paris"}'))
    assert (text.reasoning, text.text) == ("the city is Paris", '{"city": "Paris"}')


def test_a_prompt_without_think_is_all_answer_and_a_later_think_opens_reasoning(tokenizer):
    text = _assembler(tokenizer)
    text.add(_ids(tokenizer, "a<think>b</think>c"))
    assert (text.reasoning, text.text) == ("b", "ac")


def test_eos_ends_the_request_and_later_tokens_are_not_consumed(tokenizer):
    text = _assembler(tokenizer)
    ids = _ids(tokenizer, "yes") + [tokenizer.eos_token_id] + _ids(tokenizer, "more")
    assert text.add(ids) == len(_ids(tokenizer, "yes")) + 1
    assert (text.text, text.stopped_by) == ("yes", "eos")


def test_stop_string_cuts_the_answer_even_inside_a_token_but_never_the_reasoning(tokenizer):
    text = _assembler(tokenizer, prompt_text="<think>", stop=["END"])
    ids = _ids(tokenizer, "no END here</think>abcENDxyz")
    consumed = text.add(ids)
    assert text.reasoning == "no END here"
    assert (text.text, text.stopped_by) == ("abc", "END")
    assert consumed < len(ids)


def test_streamable_text_holds_back_a_possible_stop_string_prefix(tokenizer):
    text = _assembler(tokenizer, stop=["STOP"])
    text.add(_ids(tokenizer, "hello ST"))
    assert text.streamable() == ("", "hello ")
    text.add(_ids(tokenizer, "ART"))
    assert text.streamable() == ("", "hello START")


def test_mean_accepted_length_counts_the_target_token_of_each_step():
    assert GenerationStats(steps=4, drafted=16, accepted=8).mean_accepted_length == 3.0


TEXTS = ['{"city": "Paris", "note": "café ✓ 日本語"}', "  leading spaces\n\tand tabs", "ünïcödé ... €100 — done"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoding_equals_decoding_the_whole_list_with_a_short_window(tokenizer, text):
    ids = _ids(tokenizer, text)
    windows = []
    real_decode = tokenizer.decode

    class Recording:
        def decode(self, token_ids, **options):
            windows.append(len(token_ids))
            return real_decode(token_ids, **options)

    decoder, seen = IncrementalDecoder(Recording()), []
    for token in ids:
        seen.append(decoder.add(token))
    assert decoder.text == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:])), "text only grows"
    assert "\ufffd" not in "".join(seen), "a partial character is never shown"
    assert max(windows) <= 8 < len(ids), f"decoded windows of {max(windows)} ids"
