"""Tests of `IncrementalDetokenizer` on a tiny byte-level BPE tokenizer trained in a fixture."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast

from mmserve.engine.detokenizer import IncrementalDetokenizer

# Frequent words get merged into whole-character tokens; the rare characters ("ü", "世界", "🚀")
# stay split into byte tokens, so encoding them yields tokens that end mid-character.
_CORPUS = [
    "Hello world, café crème brûlée. Hello again.",
    "你好，你好吗？你好。",
    "I love 🎉 parties and the 🎉 emoji.",
    "naïve façade résumé, café, café.",
    "The quick brown fox jumps over the lazy dog.",
] * 10 + ["über 世界 🚀"]
_SPECIALS = ["<|endoftext|>", "<|im_end|>"]
_ALPHABET = [*"abc xyz.,!?\n", "é", "ü", "你", "好", "世", "界", "🎉", "🚀", "😀", "Hello", " world"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=_SPECIALS,
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        clean_up_tokenization_spaces=False,
    )


def _stream(det: IncrementalDetokenizer, ids: Sequence[int], rng: random.Random) -> list[str]:
    """Feeds `ids` in random chunks of 1-3; returns every delta, flush last."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(det.update(ids[i : i + n]))
        i += n
    deltas.append(det.flush())
    return deltas


def _random_text(rng: random.Random) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(0, 12)))


def _random_ids(tokenizer: PreTrainedTokenizerFast, rng: random.Random) -> list[int]:
    """Encoded random text, random vocabulary ids (bytes that split characters) and special tokens."""
    ids: list[int] = []
    for _ in range(rng.randint(1, 6)):
        kind = rng.random()
        if kind < 0.5:
            ids += tokenizer.encode(_random_text(rng))
        elif kind < 0.9:
            ids += [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 4))]
        else:
            ids.append(tokenizer.eos_token_id)
    return ids


def test_fixture_splits_multibyte_characters(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("über 世界 🚀")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    assert tokenizer.decode(ids) == "über 世界 🚀"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_full_decode(
    tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool
) -> None:
    rng = random.Random(1234 + skip_special_tokens)
    for _ in range(300):
        prompt = _random_ids(tokenizer, rng) if rng.random() < 0.7 else []
        output = _random_ids(tokenizer, rng)
        det = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        deltas = _stream(det, output, rng)
        full = tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == full, (prompt, output)
        assert det.output_text == full
        assert det.stop_reason is None
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas), (prompt, output, deltas)


def test_split_characters_are_held_until_complete(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "über 世界 🚀!"
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
    deltas = [det.update([i]) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some token ended mid-character and was held back
    assert det.flush() == ""


def test_flush_releases_an_unfinished_character(tokenizer: PreTrainedTokenizerFast) -> None:
    rocket = tokenizer.encode("🚀")
    assert len(rocket) > 1
    ids = tokenizer.encode("ok") + rocket[:-1]
    det = IncrementalDetokenizer(tokenizer, [])
    assert det.update(ids) == "ok"
    assert det.flush() == tokenizer.decode(rocket[:-1])
    assert det.output_text == tokenizer.decode(ids)


def test_prompt_context_keeps_leading_space(tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = tokenizer.encode("Hello")
    output = tokenizer.encode(" world, café")
    det = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(det.update([i]) for i in output) + det.flush() == " world, café"


def test_special_tokens_skipped_or_kept(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = [*tokenizer.encode("hi"), tokenizer.eos_token_id, *tokenizer.encode(" there")]
    skipping = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id])
    assert skipping.update(ids) + skipping.flush() == "hi there"
    keeping = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert keeping.update(ids) + keeping.flush() == "hi<|im_end|> there"


def test_window_stays_small(tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = tokenizer.backend_tokenizer
    longest = 0

    class Spy:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            nonlocal longest
            longest = max(longest, len(ids))
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(type(tokenizer), "backend_tokenizer", property(lambda self: Spy()))
    ids = tokenizer.encode("Hello world, café crème 你好 🎉 über 世界 🚀. " * 20)
    det = IncrementalDetokenizer(tokenizer, ids[:50], decode_stream=False)  # the Spy is no Rust tokenizer
    for i in ids:
        det.update([i])
    assert longest <= 12


def test_stop_string_split_across_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("abc STOP more")
    assert len(tokenizer.encode("STOP")) > 1
    det = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    deltas = [det.update([i]) for i in ids]
    assert "".join(deltas) == "abc "
    assert det.output_text == "abc "
    assert det.stop_reason == "STOP"
    assert not any(c in "".join(deltas) for c in "STOP")
    assert det.update(tokenizer.encode("abc")) == ""
    assert det.flush() == ""


def test_stop_string_of_multibyte_characters(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer.encode("ok 世界 no")
    det = IncrementalDetokenizer(tokenizer, [], stop=["世界"])
    deltas = [det.update([i]) for i in ids]
    assert "".join(deltas) == "ok "
    assert det.stop_reason == "世界"
    assert all("\ufffd" not in d for d in deltas)


def test_include_stop_str_in_output(tokenizer: PreTrainedTokenizerFast) -> None:
    det = IncrementalDetokenizer(tokenizer, [], stop=["STOP"], include_stop_str_in_output=True)
    deltas = [det.update([i]) for i in tokenizer.encode("abc STOP more")]
    assert "".join(deltas) == "abc STOP"
    assert det.output_text == "abc STOP"
    assert det.stop_reason == "STOP"


def test_text_after_stop_in_same_update_is_discarded(tokenizer: PreTrainedTokenizerFast) -> None:
    det = IncrementalDetokenizer(tokenizer, [], stop=["xy"])
    assert det.update(tokenizer.encode("abc xyz and more")) == "abc "
    assert det.output_text == "abc "
    assert det.stop_reason == "xy"
    assert det.update(tokenizer.encode(" later")) == ""


def test_first_completed_stop_string_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    # "b" completes before "abc" does, whatever the chunking.
    for chunk in (1, 100):
        det = IncrementalDetokenizer(tokenizer, [], stop=["abc", "b"])
        ids = tokenizer.encode("xx abc")
        for i in range(0, len(ids), chunk):
            det.update(ids[i : i + chunk])
        assert (det.output_text, det.stop_reason) == ("xx a", "b")


def test_possible_stop_prefix_is_held_then_released(tokenizer: PreTrainedTokenizerFast) -> None:
    det = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    assert det.update(tokenizer.encode("abc ST")) == "abc "
    assert det.update(tokenizer.encode("A")) == "STA"  # "STA" cannot begin "STOP"
    assert det.update(tokenizer.encode(" S")) == " "
    assert det.flush() == "S"
    assert det.output_text == "abc STA S"
    assert det.stop_reason is None


@pytest.mark.parametrize("include", [True, False])
def test_stop_strings_on_random_streams(tokenizer: PreTrainedTokenizerFast, include: bool) -> None:
    rng = random.Random(99 + include)
    for _ in range(200):
        output = tokenizer.encode("".join(rng.choice(_ALPHABET) for _ in range(30)))
        stop = rng.choice(["x", "ab", "你好", "🎉 a", "é,", "zzz"])
        det = IncrementalDetokenizer(tokenizer, [], stop=[stop], include_stop_str_in_output=include)
        deltas = _stream(det, output, rng)
        full = tokenizer.decode(output)
        if stop in full:
            end = full.index(stop) + (len(stop) if include else 0)
            assert (det.output_text, det.stop_reason) == (full[:end], stop)
        else:
            assert (det.output_text, det.stop_reason) == (full, None)
        assert "".join(deltas) == det.output_text


def test_stop_strings_wait_for_min_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    """vLLM's rule: before min_tokens output tokens exist, a stop string does not end the output."""
    ids = tokenizer.encode("STOP abc STOP more")
    first_stop_end = len(tokenizer.encode("STOP"))
    det = IncrementalDetokenizer(tokenizer, [], stop=["STOP"], min_tokens=first_stop_end + 1)
    text = "".join(det.update([i]) for i in ids)
    assert text == "STOP abc " and det.stop_reason == "STOP"  # the first one is text, the second stops
    plain = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    assert "".join(plain.update([i]) for i in ids) == "" and plain.stop_reason == "STOP"


def _metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A sentencepiece-style tokenizer: "▁" for spaces, the leading one stripped on decode."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *_SPECIALS], show_progress=False)
    bpe.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_stream_deltas_equal_the_python_window(
    tokenizer: PreTrainedTokenizerFast, kind: str, skip_special_tokens: bool
) -> None:
    """The Rust stream and the Python window give the same delta at every update, stops included."""
    tok = tokenizer if kind == "byte_level" else _metaspace_tokenizer()
    rng = random.Random(7 + skip_special_tokens)
    for _ in range(300):
        prompt = _random_ids(tok, rng) if rng.random() < 0.7 else []
        output = _random_ids(tok, rng)
        if rng.random() < 0.2:  # an id past the vocabulary (a model's padded embedding rows): decodes to nothing
            output.insert(rng.randrange(len(output) + 1), len(tok) + 5)
        stop = [rng.choice(["x", "ab", "你好", "é,", "o w"])] if rng.random() < 0.3 else []
        chunk_seed = rng.random()
        runs = []
        for decode_stream in (True, False):
            det = IncrementalDetokenizer(
                tok, prompt, stop=stop, skip_special_tokens=skip_special_tokens, decode_stream=decode_stream
            )
            runs.append((_stream(det, output, random.Random(chunk_seed)), det.output_text, det.stop_reason))
        assert runs[0] == runs[1], (prompt, output, stop)


def test_decode_stream_invalid_prefix_falls_back_to_the_python_window() -> None:
    """A decoder rule over the whole string ("ab" -> "X") makes a window's text stop extending its
    first tokens' text: the Rust stream raises, and the detokenizer carries on in Python."""
    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, " ": 4}
    rust = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    rust.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, clean_up_tokenization_spaces=False)
    ids = [3, 1, 2, 4, 1, 3, 1, 2, 2, 1]  # "c", "a", "b", " ", "a", "c", ...

    raw = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix encountered"):
        for i in ids:
            raw.step(rust, i)

    streamed = IncrementalDetokenizer(tok, [])
    window = IncrementalDetokenizer(tok, [], decode_stream=False)
    assert [streamed.update([i]) for i in ids] == [window.update([i]) for i in ids]
    assert streamed.flush() == window.flush()
    assert streamed.output_text == window.output_text
