"""Calibration token ids of the streaming one-shot command (compressor/core/token_data.py): .npy arrays cut to
the first rows and columns, text cut into evenly spread windows, and every refusal with its message. The
tokenizer here is one id per character, so every window can be read off the text."""

from __future__ import annotations

import numpy as np
import pytest

from compressor.core.errors import ConfigError
from compressor.core.token_data import (
    TEXT_READ_FACTOR,
    calibration_tokens,
    cut_token_array,
    text_token_stream,
    token_windows,
)

ALLOWED = ("allowed: an integer array [sequences, length] of token ids (.npy, or .pt with torch), or UTF-8 text "
           "(a file or a folder) tokenized with the checkpoint's tokenizer")


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def _error(path, **kw) -> str:
    kw.setdefault("num_samples", 2)
    kw.setdefault("seq_len", 3)
    with pytest.raises(ConfigError) as info:
        calibration_tokens(path, **kw)
    return str(info.value)


# -------------------------------------------------------------------------------------------------------- arrays
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.uint8])
def test_a_npy_array_gives_its_first_rows_and_columns_as_int64(tmp_path, dtype):
    array = (np.arange(50) % 200).reshape(5, 10).astype(dtype)
    np.save(tmp_path / "ids.npy", array)
    out = calibration_tokens(tmp_path / "ids.npy", num_samples=3, seq_len=4)
    assert out.dtype == np.int64 and out.flags.c_contiguous and not isinstance(out, np.memmap)
    np.testing.assert_array_equal(out, [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]])
    np.testing.assert_array_equal(calibration_tokens(str(tmp_path / "ids.npy"), num_samples=5, seq_len=10), array)


def test_only_the_part_used_is_checked(tmp_path):
    array = np.arange(20, dtype=np.int64).reshape(4, 5)
    array[3, 0] = -1  # a row not used
    array[0, 4] = -2  # a column not used
    np.save(tmp_path / "ids.npy", array)
    np.testing.assert_array_equal(calibration_tokens(tmp_path / "ids.npy", num_samples=3, seq_len=4),
                                  array[:3, :4])


@pytest.mark.parametrize("array,message", [
    (np.zeros((4, 8), np.float32), "token ids must be integers, got dtype float32; " + ALLOWED),
    (np.zeros((4, 8), bool), "token ids must be integers, got dtype bool; " + ALLOWED),
    (np.zeros(32, np.int64), "token ids must be a 2-D array [sequences, length], got shape (32,) (one stream of "
                             "ids: cut it into rows first, e.g. ids[:n * L].reshape(n, L))"),
    (np.zeros((2, 4, 8), np.int64), "token ids must be a 2-D array [sequences, length], got shape (2, 4, 8)"),
    (np.zeros((1, 8), np.int64), "holds 1 sequences, num_samples = 2 asks for more; give more sequences or ask "
                                 "for at most 1"),
    (np.zeros((4, 2), np.int64), "its sequences have 2 tokens, seq_len = 3 asks for more; give longer sequences or "
                                 "ask for a seq_len of at most 2"),
    (np.array([[0, 1, 2, 3], [4, 5, -7, 6]]), "token ids must be >= 0, got -7 at row 1, column 2"),
    (np.array([[0, 1, 2**63 + 5], [4, 5, 6]], np.uint64), f"token id {2**63 + 5} at row 0, column 2 does not fit "
                                                          f"int64"),
])
def test_a_bad_npy_array_is_refused_naming_the_file(tmp_path, array, message):
    np.save(tmp_path / "ids.npy", array)
    assert _error(tmp_path / "ids.npy") == f"--data {str(tmp_path / 'ids.npy')!r}: {message}"


def test_ids_outside_the_vocabulary_are_refused(tmp_path):
    np.save(tmp_path / "ids.npy", np.array([[0, 1, 2], [3, 99, 5]]))
    assert _error(tmp_path / "ids.npy", vocab_size=64, what="data") == (
        f"data {str(tmp_path / 'ids.npy')!r}: token id 99 at row 1, column 1 is outside the vocabulary (vocab_size "
        f"64: ids 0..63)")
    assert calibration_tokens(tmp_path / "ids.npy", num_samples=2, seq_len=3, vocab_size=100).max() == 99


def test_a_npy_file_that_numpy_cannot_map_is_refused(tmp_path):
    np.save(tmp_path / "objects.npy", np.array([[1, "a"]], dtype=object), allow_pickle=True)
    (tmp_path / "junk.npy").write_bytes(b"not an array")
    for name in ("objects.npy", "junk.npy"):
        message = _error(tmp_path / name)
        assert message.startswith(f"--data {str(tmp_path / name)!r}: not a readable .npy array (")
        assert message.endswith("); " + ALLOWED)


def test_a_npy_file_is_memory_mapped(tmp_path, monkeypatch):
    np.save(tmp_path / "ids.npy", np.arange(12).reshape(3, 4))
    seen = []
    real = np.load

    def spy(*args, **kwargs):
        seen.append(kwargs.get("mmap_mode"))
        return real(*args, **kwargs)

    monkeypatch.setattr(np, "load", spy)
    calibration_tokens(tmp_path / "ids.npy", num_samples=1, seq_len=2)
    assert seen == ["r"]


def test_cut_token_array_takes_any_integer_array():
    out = cut_token_array(np.arange(12, dtype=np.int16).reshape(3, 4), num_samples=2, seq_len=2, source="x")
    np.testing.assert_array_equal(out, [[0, 1], [4, 5]])
    assert out.dtype == np.int64


def test_pt_files_need_the_torch_loader(tmp_path):
    (tmp_path / "ids.pt").write_bytes(b"whatever")
    assert _error(tmp_path / "ids.pt") == (
        f"--data {str(tmp_path / 'ids.pt')!r}: a .pt token file is read by the torch backend "
        f"(compressor.torch.token_data.load_token_file); without it, save the ids with numpy.save as .npy")
    loaded = []

    def load_pt(path):
        loaded.append(path)
        return np.arange(12, dtype=np.int32).reshape(3, 4)

    out = calibration_tokens(tmp_path / "ids.pt", num_samples=2, seq_len=3, load_pt=load_pt)
    np.testing.assert_array_equal(out, [[0, 1, 2], [4, 5, 6]])
    assert loaded == [tmp_path / "ids.pt"]
    assert _error(tmp_path / "ids.pt", num_samples=4, load_pt=load_pt).endswith(
        "holds 3 sequences, num_samples = 4 asks for more; give more sequences or ask for at most 3")


# ---------------------------------------------------------------------------------------------------------- text
def test_windows_spread_evenly_from_the_start_to_the_end_of_the_text(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghij")  # 10 tokens
    read = lambda n, L: ["".join(map(chr, row)) for row in calibration_tokens(  # noqa: E731
        tmp_path / "a.txt", num_samples=n, seq_len=L, tokenize=chars)]
    assert read(2, 3) == ["abc", "hij"]  # starts 0, 7
    assert read(3, 3) == ["abc", "def", "hij"]  # starts 0, 3 (7 // 2), 7
    assert read(2, 5) == ["abcde", "fghij"]  # exactly enough: back to back
    assert read(1, 4) == ["abcd"]  # one window: at the start
    assert read(4, 2) == ["ab", "cd", "fg", "ij"]  # starts 0, 2 (8 // 3), 5 (16 // 3), 8
    out = calibration_tokens(tmp_path / "a.txt", num_samples=2, seq_len=3, tokenize=chars)
    assert out.dtype == np.int64 and out.shape == (2, 3)


def test_token_windows_never_overlap_and_end_at_the_stream_end():
    for total in range(12, 40):
        for n in range(1, 5):
            for length in range(1, total // n + 1):
                w = token_windows(np.arange(total), num_samples=n, seq_len=length, source="s")
                starts = w[:, 0]
                assert starts[0] == 0 and (n == 1 or w[-1, -1] == total - 1)
                assert np.all(np.diff(starts) >= length)
                np.testing.assert_array_equal(w, starts[:, None] + np.arange(length))


def test_text_shorter_than_the_windows_is_refused_with_what_would_fit(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghij")
    assert _error(tmp_path / "a.txt", num_samples=4, seq_len=3, tokenize=chars) == (
        f"--data {str(tmp_path / 'a.txt')!r}: the text gives 10 tokens; 4 windows of 3 tokens need 12 (windows "
        f"never overlap, no token is used twice); give more text, or ask for at most 3 samples (num_samples) or a "
        f"seq_len of at most 2")


def test_text_is_read_only_as_far_as_needed(tmp_path):
    (tmp_path / "a.txt").write_text("".join(chr(ord("a") + i % 26) for i in range(1000)))
    # default: 8 x 2 x 5 = 80 tokens are read, the windows spread over them
    assert TEXT_READ_FACTOR == 8
    out = calibration_tokens(tmp_path / "a.txt", num_samples=2, seq_len=5, tokenize=chars)
    assert ["".join(map(chr, r)) for r in out] == ["abcde", "xyzab"]  # starts 0 and 75
    out = calibration_tokens(tmp_path / "a.txt", num_samples=2, seq_len=3, tokenize=chars, max_text_tokens=10)
    assert ["".join(map(chr, r)) for r in out] == ["abc", "hij"]
    # a budget below what the windows need reads what they need
    out = calibration_tokens(tmp_path / "a.txt", num_samples=2, seq_len=3, tokenize=chars, max_text_tokens=1)
    assert ["".join(map(chr, r)) for r in out] == ["abc", "def"]


def test_a_folder_is_read_in_sorted_path_order_skipping_hidden_and_binary_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x.txt").write_text("DEF")
    (tmp_path / "c.md").write_text("GHI")
    (tmp_path / "a.txt").write_text("ABC")
    (tmp_path / ".hidden.txt").write_text("zzz")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("yyy")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    stream = text_token_stream(tmp_path, chars, max_tokens=100)
    assert "".join(map(chr, stream)) == "ABCDEFGHI"  # a.txt, b/x.txt, c.md
    out = calibration_tokens(tmp_path, num_samples=3, seq_len=2, tokenize=chars)
    assert ["".join(map(chr, r)) for r in out] == ["AB", "DE", "HI"]  # starts 0, 3, 7
    out = calibration_tokens(tmp_path, num_samples=2, seq_len=4, tokenize=chars)
    assert ["".join(map(chr, r)) for r in out] == ["ABCD", "FGHI"]  # a window may cross a file boundary


def test_reading_stops_once_the_stream_is_long_enough(tmp_path):
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text(name[0] * 10)
    calls = []

    def tokenize(text):
        calls.append(text)
        return chars(text)

    stream = text_token_stream(tmp_path, tokenize, max_tokens=15)
    assert "".join(map(chr, stream)) == "a" * 10 + "b" * 5
    assert calls == ["a" * 10, "b" * 10]  # c.txt is never read


def test_a_large_file_is_tokenized_in_pieces_of_whole_lines(tmp_path):
    (tmp_path / "a.txt").write_text("ab\ncd\nef", encoding="utf-8")
    calls = []

    def tokenize(text):
        calls.append(text)
        return chars(text)

    stream = text_token_stream(tmp_path / "a.txt", tokenize, max_tokens=100, chunk_bytes=4)
    assert calls == ["ab\n", "cd\n", "ef"]
    assert "".join(map(chr, stream)) == "ab\ncd\nef"
    # a character split between two reads, and a line longer than 4 pieces
    (tmp_path / "b.txt").write_text("é" * 20, encoding="utf-8")
    calls.clear()
    stream = text_token_stream(tmp_path / "b.txt", tokenize, max_tokens=100, chunk_bytes=3)
    assert "".join(map(chr, stream)) == "é" * 20 and len(calls) > 1 and "".join(calls) == "é" * 20


def test_text_needs_a_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    assert _error(tmp_path / "a.txt") == (
        f"--data {str(tmp_path / 'a.txt')!r}: text data needs the checkpoint's tokenizer (tokenizer.json), and "
        f"there is none; or give the token ids as an integer array [sequences, length] (.npy / .pt)")
    assert _error(tmp_path).startswith(f"--data {str(tmp_path)!r}: text data needs the checkpoint's tokenizer")


@pytest.mark.parametrize("make,message", [
    (lambda p: p.write_bytes(b"PK\x03\x04\x00\x00"),
     "neither a .npy / .pt token array nor UTF-8 text; " + ALLOWED),
    (lambda p: p.write_bytes(b"\xff\xfe\xfa"), "neither a .npy / .pt token array nor UTF-8 text; " + ALLOWED),
])
def test_a_binary_file_is_refused_even_without_a_tokenizer(tmp_path, make, message):
    make(tmp_path / "data.npz")
    assert _error(tmp_path / "data.npz") == f"--data {str(tmp_path / 'data.npz')!r}: {message}"
    assert _error(tmp_path / "data.npz", tokenize=chars) == f"--data {str(tmp_path / 'data.npz')!r}: {message}"


def test_a_folder_without_text_is_refused(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01")
    (tmp_path / ".notes.txt").write_text("hidden")
    message = (f"--data {str(tmp_path)!r}: the folder holds no UTF-8 text files (hidden and binary files are "
               f"skipped); " + ALLOWED)
    assert _error(tmp_path, tokenize=chars) == message
    assert _error(tmp_path) == message


def test_bad_bytes_after_the_first_piece_name_the_file_and_the_offset(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"abc\n" * 4096 + b"ab\xffc\n")
    assert _error(tmp_path / "a.txt", tokenize=chars, max_text_tokens=10**6) == (
        f"--data {str(tmp_path / 'a.txt')!r}: {str(tmp_path / 'a.txt')!r} is not UTF-8 text (byte 16386); " + ALLOWED)


def test_empty_text_and_bad_tokenizer_output_are_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    label = f"--data {str(tmp_path / 'empty.txt')!r}"
    assert _error(tmp_path / "empty.txt", tokenize=chars) == f"{label}: the text gives no tokens; " + ALLOWED
    (tmp_path / "a.txt").write_text("hello")
    label = f"--data {str(tmp_path / 'a.txt')!r}"
    assert _error(tmp_path / "a.txt", tokenize=lambda s: [0.5] * len(s)) == (
        f"{label}: the tokenizer must return a list of int ids, got float64 of shape (5,) for "
        f"{str(tmp_path / 'a.txt')!r}")
    assert _error(tmp_path / "a.txt", tokenize=lambda s: [3, -1]) == (
        f"{label}: tokenizer output for {str(tmp_path / 'a.txt')!r}: token ids must be >= 0, got -1 at position 1")
    assert _error(tmp_path / "a.txt", tokenize=chars, num_samples=1, seq_len=5, vocab_size=100) == (
        f"{label}: token id 104 at row 0, column 0 is outside the vocabulary (vocab_size 100: ids 0..99)")


@pytest.mark.parametrize("kw,message", [
    ({"num_samples": 0}, "num_samples must be an int >= 1, got 0"),
    ({"seq_len": 2.0}, "seq_len must be an int >= 1, got 2.0"),
    ({"num_samples": True}, "num_samples must be an int >= 1, got True"),
])
def test_sizes_must_be_positive_ints(tmp_path, kw, message):
    np.save(tmp_path / "ids.npy", np.zeros((4, 4), np.int64))
    assert _error(tmp_path / "ids.npy", **kw) == message


def test_a_missing_path_is_refused(tmp_path):
    assert _error(tmp_path / "nope.npy") == f"--data {str(tmp_path / 'nope.npy')!r}: no such file or folder"
