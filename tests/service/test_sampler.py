"""Sampling knobs, per-request reproducibility, and streaming text with stop strings."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from service.engine.sampler import Sampler
from service.engine.text_stream import IncrementalDecoder, TextStream
from service.engine.types import SamplingParams
from service.tokenizers import ByteTokenizer

LOGITS = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.0])


def draws(params: SamplingParams, count: int = 40) -> list[int]:
    sampler = Sampler(params)
    return [sampler.sample(LOGITS)[0] for _ in range(count)]


def test_greedy_takes_the_argmax_and_reports_the_raw_logprob() -> None:
    token, logprob = Sampler(SamplingParams(temperature=0.0)).sample(LOGITS)
    assert token == 1
    assert logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[1]))


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1e-300, seed=3), SamplingParams(top_p=1e-300, seed=3)],
    ids=["temperature-underflows-float32", "top-p-underflows-float32"],
)
def test_tiny_positive_knobs_reach_the_greedy_limit(params: SamplingParams) -> None:
    assert set(draws(params)) == {1}


def test_logprobs_ignore_temperature_and_filters() -> None:
    sampler = Sampler(SamplingParams(temperature=0.3, top_k=2, top_p=0.5, seed=1))
    raw = torch.log_softmax(LOGITS, -1)
    for _ in range(10):
        token, logprob = sampler.sample(LOGITS)
        assert logprob == pytest.approx(float(raw[token]))


def test_top_k_and_top_p_restrict_the_candidates() -> None:
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=0))) <= {1, 3}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.01, seed=0))) == {1}
    assert set(draws(SamplingParams(temperature=5.0, seed=0), count=200)) == {0, 1, 2, 3, 4}


def test_a_seed_fixes_the_draws_and_different_seeds_differ() -> None:
    params = SamplingParams(temperature=2.0, seed=7)
    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(temperature=2.0, seed=8))


def stream_all(text: str, stop: tuple[str, ...]) -> tuple[list[str], TextStream]:
    tokenizer = ByteTokenizer()
    stream = TextStream(tokenizer.decode, stop)
    pieces = []
    tokens = tokenizer.encode(text)
    for index, token in enumerate(tokens):
        pieces.append(stream.push(token, final=index == len(tokens) - 1))
        if stream.stopped:
            break
    return pieces, stream


def test_text_stops_before_the_stop_string_and_never_streams_part_of_it() -> None:
    pieces, stream = stream_all("abc\n\ndef", stop=("\n\n",))
    assert stream.stopped and stream.text == "abc"
    assert "".join(pieces) == "abc"


def test_a_partial_stop_string_is_released_once_it_cannot_match() -> None:
    pieces, stream = stream_all("ab\nc", stop=("\n\n",))
    assert not stream.stopped
    assert pieces == ["a", "b", "", "\nc"]


def test_multibyte_characters_are_released_whole() -> None:
    pieces, stream = stream_all("é€x", stop=())
    assert pieces == ["", "é", "", "", "€", "x"]
    assert stream.text == "é€x"


def test_incremental_decoding_equals_decoding_everything() -> None:
    """Random bytes (multi-byte characters cut anywhere, specials included) and a BPE tokenizer."""
    generator = torch.Generator().manual_seed(0)
    byte_tokens = torch.randint(0, 258, (300,), generator=generator).tolist()
    byte_tokens += list("naïve café ∑ 🙂 ".encode()) * 3
    corpus = ["def f(x):\n    return x + 1\n", "naïve café 🙂", "the quick brown fox"] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    bpe_tokens = bpe.encode("".join(corpus[:5])).ids
    cases = [(ByteTokenizer().decode, byte_tokens), (lambda ids: bpe.decode(ids), bpe_tokens)]
    for decode, tokens in cases:
        decoder = IncrementalDecoder(decode)
        for count, token in enumerate(tokens, start=1):
            assert decoder.append(token) == decode(tokens[:count])
