"""The corpus reader on a small stdlib-shaped tree, and the real stdlib's split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.tokenizers import ByteTokenizer
from training.corpus import (
    consecutive_windows,
    is_held_out,
    load_corpus,
    random_windows,
    source_files,
    stdlib_root,
    token_stream,
)


@pytest.fixture
def fake_stdlib(tmp_path: Path) -> Path:
    files = {
        "os.py": b"import sys\n",
        "json/decoder.py": b"def decode(s):\n    return s\n",
        "site-packages/numpy/core.py": b"third party\n",
        "test/test_os.py": b"fixture\n",
        "idlelib/idle_test/htest.py": b"fixture\n",
        "encodings/cp1006.py": b'""" Python Character Mapping Codec cp1006 generated with gencodec.py.\n',
        "README.txt": b"not python\n",
    }
    for relative, content in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return tmp_path


def test_source_files_keeps_library_code_only_in_sorted_order(fake_stdlib: Path) -> None:
    assert source_files(fake_stdlib) == ["json/decoder.py", "os.py"]


def test_token_stream_frames_each_file_with_bos_and_eos(fake_stdlib: Path) -> None:
    tokenizer = ByteTokenizer()
    stream = token_stream(fake_stdlib, ["os.py", "os.py"]).tolist()
    framed = [tokenizer.bos_id, *b"import sys\n", tokenizer.eos_id]
    assert stream == framed + framed


def test_split_depends_on_the_path_alone() -> None:
    paths = [f"pkg/module_{index}.py" for index in range(5000)]
    held_out = [path for path in paths if is_held_out(path)]
    assert held_out == [path for path in reversed(paths) if is_held_out(path)][::-1]
    assert 0.01 < len(held_out) / len(paths) < 0.03


def test_real_stdlib_split_is_disjoint_and_mostly_train() -> None:
    corpus = load_corpus(stdlib_root())
    assert not set(corpus.train_files) & set(corpus.held_out_files)
    assert 0.005 < len(corpus.held_out_files) / len(corpus.train_files) < 0.05
    assert corpus.train.numel() > 1_000_000 and corpus.held_out.numel() > 50_000
    assert int(corpus.train.max()) < ByteTokenizer.vocab_size


def test_random_windows_are_seeded_and_targets_are_shifted_inputs() -> None:
    stream = torch.arange(1000)
    first = random_windows(stream, 4, 16, torch.Generator().manual_seed(3))
    second = random_windows(stream, 4, 16, torch.Generator().manual_seed(3))
    inputs, targets = first
    assert inputs.shape == targets.shape == (4, 16)
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(targets, inputs + 1)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_consecutive_windows_drop_the_short_tail_and_respect_the_cap() -> None:
    stream = torch.arange(10)
    assert consecutive_windows(stream, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert consecutive_windows(stream, 4, max_windows=1).tolist() == [[0, 1, 2, 3]]
