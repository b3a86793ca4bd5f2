"""The torch side of the streaming command's calibration data (compressor/torch/token_data.py): a checkpoint's
tokenizer.json built here with the ``tokenizers`` package (no downloads), and .pt token files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compressor.core.errors import ConfigError
from compressor.core.token_data import calibration_tokens
from compressor.torch.token_data import checkpoint_tokenizer, load_token_file

tokenizers = pytest.importorskip("tokenizers")

VOCAB = {"[UNK]": 0, "[BOS]": 1, "the": 2, "cat": 3, "sat": 4, "on": 5, "mat": 6, ".": 7, "a": 8, "dog": 9}
ALLOWED = ("allowed: an integer array [sequences, length] of token ids (.npy, or .pt with torch), or UTF-8 text "
           "(a file or a folder) tokenized with the checkpoint's tokenizer")


def _word_level(src_dir):
    """A checkpoint directory whose tokenizer.json maps words to VOCAB and puts [BOS] before every encoding
    (as Llama's does): the streaming command must not get the [BOS]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    src_dir.mkdir(exist_ok=True)
    tok.save(str(src_dir / "tokenizer.json"))
    assert tok.encode("the cat").ids == [1, 2, 3]  # the library adds it by default
    return src_dir


def test_the_checkpoint_tokenizer_gives_the_word_ids_without_special_tokens(tmp_path):
    tokenize = checkpoint_tokenizer(_word_level(tmp_path / "ckpt"))
    assert tokenize("the cat sat on the mat.") == [2, 3, 4, 5, 2, 6, 7]
    assert tokenize("a dog sat on a zebra") == [8, 9, 4, 5, 8, 0]
    assert tokenize("") == []


def test_text_data_becomes_windows_of_the_checkpoint_tokenizer_ids(tmp_path):
    tokenize = checkpoint_tokenizer(_word_level(tmp_path / "ckpt"))
    (tmp_path / "calib.txt").write_text("the cat sat on the mat.\na dog sat on a mat.\n")
    out = calibration_tokens(tmp_path / "calib.txt", num_samples=3, seq_len=4, tokenize=tokenize, vocab_size=10)
    # stream: the cat sat on the mat . a dog sat on a mat . (14 ids); starts 0, 5, 10
    np.testing.assert_array_equal(out, [[2, 3, 4, 5], [6, 7, 8, 9], [5, 8, 6, 7]])


def test_a_trained_bpe_tokenizer_round_trips(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    sentences = ["the cat sat on the mat", "a dog sat on a log", "the dog saw the cat", "cats and dogs sat"] * 4
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sentences, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenize = checkpoint_tokenizer(tmp_path)
    text = "the cat saw a dog on the log"
    ids = tokenize(text)
    assert ids == tok.encode(text, add_special_tokens=False).ids
    assert all(isinstance(i, int) for i in ids) and len(ids) < len(text)  # merges learnt from the sentences
    assert tok.decode(ids) == text


def test_no_tokenizer_json_is_none_and_a_broken_one_is_refused(tmp_path):
    assert checkpoint_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError) as info:
        checkpoint_tokenizer(tmp_path)
    assert str(info.value).startswith(f"{str(tmp_path / 'tokenizer.json')!r}: not a tokenizer file the "
                                      f"'tokenizers' package reads (")


# --------------------------------------------------------------------------------------------------- .pt files
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_a_pt_tensor_is_read_as_numpy_and_cut_like_a_npy_array(tmp_path, dtype):
    ids = torch.arange(24).reshape(4, 6).to(dtype)
    torch.save(ids, tmp_path / "ids.pt")
    array = load_token_file(tmp_path / "ids.pt")
    assert isinstance(array, np.ndarray)
    np.testing.assert_array_equal(array, ids.numpy())
    out = calibration_tokens(tmp_path / "ids.pt", num_samples=2, seq_len=3, load_pt=load_token_file)
    np.testing.assert_array_equal(out, [[0, 1, 2], [6, 7, 8]])
    assert out.dtype == np.int64


def test_a_dict_with_input_ids_is_read(tmp_path):
    torch.save({"input_ids": torch.arange(6).reshape(2, 3), "attention_mask": torch.ones(2, 3)}, tmp_path / "b.pt")
    np.testing.assert_array_equal(load_token_file(tmp_path / "b.pt"), [[0, 1, 2], [3, 4, 5]])


@pytest.mark.parametrize("obj,message", [
    (torch.zeros(4, 8), "token ids must be integers, got dtype float32; " + ALLOWED),
    (torch.zeros(4, 8, dtype=torch.bfloat16), "token ids must be integers, got dtype bfloat16; " + ALLOWED),
    (torch.zeros(4, 8, dtype=torch.bool), "token ids must be integers, got dtype bool; " + ALLOWED),
    (torch.zeros(32, dtype=torch.int64), "token ids must be a 2-D array [sequences, length], got shape (32,) (one "
                                         "stream of ids: cut it into rows first, e.g. ids[:n * L].reshape(n, L))"),
    (torch.zeros(2, 4, 8, dtype=torch.int64), "token ids must be a 2-D array [sequences, length], got shape "
                                              "(2, 4, 8)"),
    ([1, 2, 3], "holds a list, not a tensor of token ids [sequences, length] (or a dict with one under "
                "'input_ids')"),
    ({"ids": torch.zeros(2, 2)}, "holds a dict, not a tensor of token ids [sequences, length] (or a dict with one "
                                 "under 'input_ids')"),
])
def test_a_bad_pt_file_is_refused_as_a_npy_array_would_be(tmp_path, obj, message):
    torch.save(obj, tmp_path / "ids.pt")
    with pytest.raises(ConfigError) as info:
        load_token_file(tmp_path / "ids.pt")
    assert str(info.value) == f"--data {str(tmp_path / 'ids.pt')!r}: {message}"


def test_the_ids_of_a_pt_file_are_checked_where_they_are_cut(tmp_path):
    torch.save(torch.tensor([[0, 1, 2], [3, -4, 5]]), tmp_path / "ids.pt")
    with pytest.raises(ConfigError) as info:
        calibration_tokens(tmp_path / "ids.pt", num_samples=2, seq_len=3, load_pt=load_token_file, what="data")
    assert str(info.value) == f"data {str(tmp_path / 'ids.pt')!r}: token ids must be >= 0, got -4 at row 1, column 1"


class _Code:
    pass


def test_a_file_torch_will_not_load_safely_is_refused(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    torch.save(_Code(), tmp_path / "code.pt")  # unpickling would run code: weights_only refuses
    for name in ("junk.pt", "code.pt"):
        with pytest.raises(ConfigError) as info:
            load_token_file(tmp_path / name)
        assert str(info.value).startswith(f"--data {str(tmp_path / name)!r}: not a tensor file torch.load reads "
                                          f"with weights_only=True (")


def test_a_legacy_format_file_is_read_without_memory_mapping(tmp_path):
    torch.save(torch.arange(6).reshape(2, 3), tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    np.testing.assert_array_equal(load_token_file(tmp_path / "old.pt"), [[0, 1, 2], [3, 4, 5]])
