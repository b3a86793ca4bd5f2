"""The compressed-tensors checkpoint reader (compressor.core.compressed_tensors) reads a checkpoint exactly or
refuses it: damaged checkpoints built with the project's own writer, each refusal with its exact message (the
file or config.json, the layer, the missing tensor and the format); config values of the wrong type; ``re:``
targets matched by the reader's automaton (the same answers as ``re.match``, in steps linear in the name); the
header and decoded-size caps (refused with bounded work); memory-mapped reading (the weights plus a chunk);
files that are not regular files; and a fixed-seed fuzz of damaged checkpoints: never a wrong weight."""

from __future__ import annotations

import json
import os
import random
import re
import struct
import sys
import tracemalloc

import numpy as np
import pytest

import compressor.core.compressed_tensors as ct
from compressor.core.compressed_tensors import (
    CheckpointError,
    bitmask_entries,
    checkpoint_report,
    decoded_cap,
    load_compressed_tensors,
    naive_quantized_entries,
    pack_quantized_entries,
    quant_args,
    read_safetensors,
    sparse24_entries,
    write_safetensors,
)
from compressor.core.errors import ConfigError, ModelError
from tests.core.test_hostile_files import LineCounter

CODES = np.array([[-7, 7, 0, 1, 2, 3, -1, -2], [1, 1, 1, 1, 0, 0, 0, 0]])
SCALE = np.array([[0.5, 0.25], [1.0, 2.0]])
UCODES = CODES + 8  # asymmetric layers: unsigned codes and zero points
ZP = np.array([[8, 9], [7, 8]])
SPARSE = np.array([[0, 1.5, 0, 0, 0, 0, 0, 2], [0, 0, 0, 0, 0, 0, 0, 0]], np.float32)
S24 = np.array([[0, 1.5, 0, 3, 0, 0, 0, 2], [4, 0, 0, 5, 0, 6, 7, 0]], np.float32)


def qc_of(groups: dict, sparse: str | None = None, fmt: str = "mixed-precision") -> dict:
    qc = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": groups}
    if sparse:
        qc["sparsity_config"] = {"format": sparse, "targets": ["Linear"]}
    return qc


def group(targets: list, bits: int = 4, gs: int | None = 4, sym: bool = True, fmt: str = "pack-quantized") -> dict:
    return {"targets": targets, "weights": quant_args(bits, gs, sym), "format": fmt}


def write(folder, tensors: dict, qc: dict) -> str:
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"torch_dtype": "float32", "quantization_config": qc}, f)
    return folder


def quantized_sparse(folder) -> str:
    """'p' pack-quantized symmetric, 'a' pack-quantized asymmetric, 'n' naive-quantized asymmetric (all 4 bits,
    groups of 4), 's' sparse-bitmask, 'emb.weight' float."""
    tensors = {**pack_quantized_entries("p", CODES, SCALE, None, 4, True),
               **pack_quantized_entries("a", UCODES, SCALE, ZP, 4, False),
               **naive_quantized_entries("n", UCODES, SCALE, ZP, 4, False),
               **bitmask_entries("s", SPARSE), "emb.weight": np.arange(8, dtype=np.float32).reshape(4, 2)}
    return write(folder, tensors, qc_of({"g0": group(["p"]), "g1": group(["a"], sym=False),
                                         "g2": group(["n"], sym=False, fmt="naive-quantized")}, "sparse-bitmask"))


def sparse24(folder) -> str:
    return write(folder, sparse24_entries("t", S24), {"quant_method": "compressed-tensors",
                                                      "sparsity_config": {"format": "sparse-24-bitmask"}})


def expected_quantized() -> dict:
    g = np.repeat(SCALE, 4, axis=1)
    return {"p.weight": (CODES * g).astype(np.float32), "a.weight": ((CODES - np.repeat(ZP - 8, 4, axis=1)) * g).astype(
        np.float32), "n.weight": ((CODES - np.repeat(ZP - 8, 4, axis=1)) * g).astype(np.float32), "s.weight": SPARSE,
        "emb.weight": np.arange(8, dtype=np.float32).reshape(4, 2)}


def rewrite(folder: str, drop: tuple = (), put: dict | None = None, config=None) -> str:
    path = os.path.join(folder, "model.safetensors")
    tensors = read_safetensors(path)
    for k in drop:
        del tensors[k]
    tensors.update(put or {})
    write_safetensors(path, tensors)
    if config is not None:
        cfg_path = os.path.join(folder, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        config(cfg["quantization_config"])
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    return path


def refused(folder: str) -> str:
    with pytest.raises(CheckpointError) as e:
        load_compressed_tensors(folder)
    assert isinstance(e.value, ModelError)
    with pytest.raises(CheckpointError) as r:  # the report checks the same
        checkpoint_report(folder)
    assert str(r.value) == str(e.value)
    return str(e.value)


def test_the_valid_checkpoints_read_exactly(tmp_path):
    got = load_compressed_tensors(quantized_sparse(tmp_path / "q"))
    want = expected_quantized()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k
    np.testing.assert_array_equal(load_compressed_tensors(sparse24(tmp_path / "t"))["t.weight"], S24)


# ------------------------------------------------------------------------------------------ missing tensors
MISSING = [
    ("quantized", "p.weight_scale", "layer 'p' (pack-quantized): lacks ['p.weight_scale'], which the pack-quantized "
                                    "format needs"),
    ("quantized", "p.weight_packed", "layer 'p' (pack-quantized): lacks ['p.weight_packed'], which the pack-quantized "
                                     "format needs"),
    ("quantized", "p.weight_shape", "layer 'p' (pack-quantized): lacks ['p.weight_shape'], which the pack-quantized "
                                    "format needs"),
    ("quantized", "a.weight_zero_point", "layer 'a' (pack-quantized): lacks ['a.weight_zero_point'], which the "
                                         "pack-quantized format needs"),
    ("quantized", "n.weight_scale", "layer 'n' (naive-quantized): lacks ['n.weight_scale'], which the naive-quantized "
                                    "format needs"),
    ("quantized", "n.weight", "layer 'n' (naive-quantized): lacks ['n.weight'], which the naive-quantized format "
                              "needs"),
    ("quantized", "s.compressed", "layer 's' (sparse-bitmask): lacks ['s.compressed'], which the sparse-bitmask format "
                                  "needs"),
    ("quantized", "s.bitmask", "layer 's' (sparse-bitmask): lacks ['s.bitmask'], which the sparse-bitmask format "
                               "needs"),
    ("quantized", "s.row_offsets", "layer 's' (sparse-bitmask): lacks ['s.row_offsets'], which the sparse-bitmask "
                                   "format needs"),
    ("quantized", "s.shape", "layer 's' (sparse-bitmask): lacks ['s.shape'], which the sparse-bitmask format needs"),
    ("24", "t.compressed", "layer 't' (sparse-24-bitmask): lacks ['t.compressed'], which the sparse-24-bitmask format "
                           "needs"),
    ("24", "t.bitmask", "layer 't' (sparse-24-bitmask): lacks ['t.bitmask'], which the sparse-24-bitmask format "
                        "needs"),
]


@pytest.mark.parametrize("kind,drop,message", MISSING, ids=[m[1] for m in MISSING])
def test_a_layer_lacking_a_tensor_of_its_format_is_refused(tmp_path, kind, drop, message):
    folder = quantized_sparse(tmp_path / "ck") if kind == "quantized" else sparse24(tmp_path / "ck")
    path = rewrite(folder, drop=(drop,))
    assert refused(folder) == f"{path!r}: {message}"


def test_int8_codes_without_their_scale_are_not_returned_as_weights(tmp_path):
    """A symmetric naive-quantized layer stores codes and scales only: without the scale its codes look like a
    plain tensor. Refused when the config names the layer, and (class-name or re: targets) for integer dtypes."""
    codes = naive_quantized_entries("q", CODES, SCALE, None, 4, True)["q.weight"]
    for targets in (["q"], ["Linear"], ["re:^q$"]):
        folder = write(tmp_path / targets[0].replace(":", "_").replace("^", "").replace("$", ""), {"q.weight": codes},
                       qc_of({"g": group(targets, fmt="naive-quantized")}))
        path = os.path.join(folder, "model.safetensors")
        if targets == ["q"]:
            assert refused(folder) == (
                f"{path!r}: layer 'q' is a target of config group 'g' (naive-quantized) but is stored as a plain "
                f"q.weight: the tensors that format needs (q.weight_packed / q.weight, q.weight_scale) are missing")
        else:
            assert refused(folder) == (f"{path!r}: 'q.weight' holds int8 values (quantized codes?) but there is no "
                                       f"q.weight_scale: a quantized layer needs its scales")
    # a float weight beside a class-name target is a layer the writer kept dense: read as it is
    folder = write(tmp_path / "float", {"q.weight": SPARSE}, qc_of({"g": group(["Linear"])}))
    np.testing.assert_array_equal(load_compressed_tensors(folder)["q.weight"], SPARSE)


def test_what_this_reader_cannot_apply_or_reads_twice_is_refused(tmp_path):
    folder = quantized_sparse(tmp_path / "gidx")
    path = rewrite(folder, put={"p.weight_g_idx": np.zeros(8, np.int32)})
    assert refused(folder) == (f"{path!r}: layer 'p' (pack-quantized): holds p.weight_g_idx (activation-order group "
                               f"indices), which this reader does not apply")
    folder = quantized_sparse(tmp_path / "twice")
    path = rewrite(folder, put={"s.weight": SPARSE})
    assert refused(folder) == f"{path!r}: layer 's' (sparse-bitmask): is stored sparse-bitmask and also as a dense s.weight"
    folder = quantized_sparse(tmp_path / "both")
    path = rewrite(folder, put={"p.weight": CODES.astype(np.int8)})
    assert refused(folder) == (f"{path!r}: layer 'p' (pack-quantized): holds p.weight beside the pack-quantized tensors "
                               f"['p.weight', 'p.weight_packed', 'p.weight_scale', 'p.weight_shape']")
    folder = quantized_sparse(tmp_path / "noconfig")
    path = rewrite(folder, config=lambda qc: qc.pop("config_groups"))
    assert refused(folder) == (f"{path!r}: layer 'a' (pack-quantized): holds quantized tensors ['a.weight_packed', "
                               f"'a.weight_scale', 'a.weight_shape', 'a.weight_zero_point'] but the config has no "
                               f"quantization_config.config_groups")


# ------------------------------------------------------------------------------------------ dtypes and shapes
WRONG = [
    ("p.weight_shape", np.array([2.0, 8.0]), "layer 'p' (pack-quantized): p.weight_shape is float64 [2], expected 2 "
                                             "integers (the weight's shape)"),
    ("p.weight_shape", np.array([2, 8, 1]), "layer 'p' (pack-quantized): p.weight_shape is int64 [3], expected 2 "
                                            "integers (the weight's shape)"),
    ("p.weight_scale", np.ones((2, 2), np.int32), "layer 'p' (pack-quantized): weight_scale is int32 [2, 2], expected "
                                                  "a float [2, 2]"),
    ("p.weight_scale", np.ones((2, 1), np.float32), "layer 'p' (pack-quantized): weight_scale is float32 [2, 1], "
                                                    "expected a float [2, 2]"),
    ("p.weight_packed", np.zeros((2, 1), np.int64), "layer 'p' (pack-quantized): weight_packed is int64 [2, 1], "
                                                    "expected int32 [2, 1] for weight_shape [2, 8] at 4 bits"),
    ("a.weight_zero_point", np.zeros((2, 2), np.int32), "layer 'a' (pack-quantized): weight_zero_point is int32 "
                                                        "[2, 2], expected int32 [1, 2]"),
    ("n.weight", np.zeros((2, 8), np.int16), "layer 'n' (naive-quantized): n.weight is int16 [2, 8], expected 2-D int8 "
                                             "codes"),
    ("n.weight_zero_point", np.zeros((2, 2), np.float32), "layer 'n' (naive-quantized): weight_zero_point is float32 "
                                                          "[2, 2], expected integers [2, 2]"),
    ("s.bitmask", np.zeros((2, 1), np.int8), "layer 's' (sparse-bitmask): bitmask is int8 [2, 1], expected uint8 "
                                             "[2, 1]"),
    ("s.compressed", np.array([1, 2], np.int32), "layer 's' (sparse-bitmask): compressed (the kept values) is int32, "
                                                 "expected a float dtype"),
    ("s.compressed", np.array([[1.5, 2.0]], np.float32), "layer 's' (sparse-bitmask): compressed is [1, 2], expected "
                                                         "1-D (the kept values, row-major)"),
    ("s.row_offsets", np.array([0.0, 2.0]), "layer 's' (sparse-bitmask): row_offsets is float64 [2], expected "
                                            "integers [2]"),
    ("s.compressed", np.array([1.5, 2.0, 3.0], np.float32), "layer 's' (sparse-bitmask): 3 stored values but the "
                                                            "bitmask marks 2"),
    ("s.row_offsets", np.array([0, 1]), "layer 's' (sparse-bitmask): row_offsets do not match the bitmask"),
]


@pytest.mark.parametrize("name,value,message", WRONG, ids=[f"{w[0]}-{i}" for i, w in enumerate(WRONG)])
def test_tensors_of_another_dtype_or_shape_than_the_config_implies(tmp_path, name, value, message):
    folder = quantized_sparse(tmp_path / "ck")
    path = rewrite(folder, put={name: value})
    assert refused(folder) == f"{path!r}: {message}"


def test_naive_codes_outside_the_configured_bits_are_refused(tmp_path):
    folder = quantized_sparse(tmp_path / "ck")
    path = rewrite(folder, put={"n.weight": np.full((2, 8), 9, np.int8)})
    assert refused(folder) == f"{path!r}: layer 'n' (naive-quantized): codes outside the signed 4-bit range [-8, 7]"
    folder = quantized_sparse(tmp_path / "zp")
    path = rewrite(folder, put={"n.weight_zero_point": np.array([[0, 1], [255, 0]], np.uint8)})
    assert refused(folder) == (f"{path!r}: layer 'n' (naive-quantized): zero points outside the signed 4-bit range "
                               f"[-8, 7]")


def test_packed_codes_wider_than_the_config_says_are_refused(tmp_path):
    """4-bit rows of 8 codes fill one int32 word, as 2-bit rows of 8 codes do (with 16 bits of zero padding):
    the padding tells them apart, for the codes and for the zero points packed along the output axis."""
    folder = quantized_sparse(tmp_path / "ck")
    path = rewrite(folder, config=lambda qc: qc["config_groups"]["g0"]["weights"].update(num_bits=2))
    assert refused(folder) == (f"{path!r}: layer 'p' (pack-quantized): p.weight_packed has bits set past the 8 codes "
                               f"of 2 bits of row 0 (the padding is zero as written): the codes are wider or more than "
                               f"the config's num_bits and shape say")
    folder = quantized_sparse(tmp_path / "zp")
    zp = pack_quantized_entries("a", UCODES, SCALE, ZP, 4, False)["a.weight_zero_point"]
    path = rewrite(folder, put={"a.weight_zero_point": zp | np.int32(1 << 20)})
    assert refused(folder) == (f"{path!r}: layer 'a' (pack-quantized): a.weight_zero_point has bits set past the 2 "
                               f"codes of 4 bits of column 0 (the padding is zero as written): the codes are wider or "
                               f"more than the config's num_bits and shape say")


def test_symmetric_layers_may_hold_zero_zero_points_only(tmp_path):
    folder = quantized_sparse(tmp_path / "ck")
    zero = pack_quantized_entries("p", CODES + 8, SCALE, np.full((2, 2), 8), 4, False)["p.weight_zero_point"]
    rewrite(folder, put={"p.weight_zero_point": zero})  # zeros, as older writers kept them: read as before
    np.testing.assert_array_equal(load_compressed_tensors(folder)["p.weight"], expected_quantized()["p.weight"])
    path = rewrite(folder, put={"p.weight_zero_point": pack_quantized_entries("p", UCODES, SCALE, ZP, 4, False)[
        "p.weight_zero_point"]})
    assert refused(folder) == (f"{path!r}: layer 'p' (pack-quantized): config group 'g0' says symmetric, but "
                               f"p.weight_zero_point holds non-zero zero points (is 'symmetric' right?)")


# ------------------------------------------------------------------------------------------ config values
CONFIG = [
    ("symmetric", "false", "true or false (a JSON boolean, not a string or number)"),
    ("symmetric", "true", "true or false (a JSON boolean, not a string or number)"),
    ("symmetric", 0, "true or false (a JSON boolean, not a string or number)"),
    ("symmetric", None, "true or false (a JSON boolean, not a string or number)"),
    ("dynamic", "false", "false (a JSON boolean)"),
    ("dynamic", True, "false (weights quantized dynamically store no scales to decode)"),
    ("num_bits", True, "an int in 1..8"),
    ("num_bits", "4", "an int in 1..8"),
    ("num_bits", 9, "an int in 1..8"),
    ("group_size", 4.0, "a positive int for strategy 'group'"),
    ("group_size", True, "a positive int for strategy 'group'"),
    ("strategy", "tensor", "'group' or 'channel' (the strategies this reader decodes)"),
    ("type", "float", "'int' (this reader decodes integer weights only)"),
    ("actorder", "group", "null, 'weight' or 'static' (activation-order group indices, weight_g_idx, are not applied "
                          "by this reader)"),
]


@pytest.mark.parametrize("key,value,expected", CONFIG, ids=[f"{c[0]}={c[1]!r}" for c in CONFIG])
def test_config_values_of_the_wrong_type_are_refused_naming_key_and_value(tmp_path, key, value, expected):
    folder = quantized_sparse(tmp_path / "ck")
    rewrite(folder, config=lambda qc: qc["config_groups"]["g1"]["weights"].update({key: value}))
    cfg = os.path.join(folder, "config.json")
    assert refused(folder) == (f"{cfg!r}: config_groups.g1.weights.{key} is {value!r} (used by layer 'a'); "
                               f"expected {expected}")


def test_symmetric_false_string_was_read_as_true_and_dropped_the_zero_points(tmp_path):
    """The issue's case: '"symmetric": "false"' is truthy; read as symmetric, the zero points were ignored."""
    folder = quantized_sparse(tmp_path / "ck")
    rewrite(folder, config=lambda qc: qc["config_groups"]["g2"]["weights"].update(symmetric="false"))
    assert "config_groups.g2.weights.symmetric is 'false' (used by layer 'n')" in refused(folder)


def test_a_group_size_that_does_not_divide_the_columns(tmp_path):
    folder = quantized_sparse(tmp_path / "ck")
    rewrite(folder, config=lambda qc: qc["config_groups"]["g0"]["weights"].update(group_size=3))
    assert refused(folder) == (f"{os.path.join(folder, 'config.json')!r}: config_groups.g0.weights.group_size 3 does "
                               f"not divide the 8 input columns of layer 'p'")


# ------------------------------------------------------------------------------------------ re: targets
def random_pattern(rng: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", ".", r"\.", r"\d", r"\w", "[ab]", "[^a]", "x", "(?:a|b)", "(a|ab)", "(a*)", "[.]", r"\s", "{",
             "}", "]", "0", r"\x61", r"\141", "(?P<n>b)"]
    quants = ["", "", "", "*", "+", "?", "{2}", "{0,3}", "{1,}", "{,2}", "*?", "+?", "{}", "{,}", "{a}"]
    parts = []
    for _ in range(rng.randrange(1, 5)):
        atom = "(" + random_pattern(rng, depth + 1) + ")" if depth < 2 and rng.random() < 0.25 else rng.choice(atoms)
        parts.append(atom + rng.choice(quants))
    text = "".join(parts)
    if rng.random() < 0.2:
        text += "|" + random_pattern(rng, depth + 1)
    return ("^" if rng.random() < 0.1 else r"\A" if rng.random() < 0.05 else "") + text + (
        "$" if rng.random() < 0.2 else r"\Z" if rng.random() < 0.05 else "")


def test_the_automaton_answers_as_re_match():
    """Fixed-seed differential test on short names (where Python's re is quick)."""
    rng = random.Random(45)
    names = ["", "a", "ab", "aab", "a.b", "x1", "ba", "a\n", "abab", "0a", "a b", "aaaa", "{}", "a}", "b\n\n"]
    compared = 0
    for _ in range(400):
        pattern = random_pattern(rng)
        try:
            compiled = re.compile(pattern)
        except re.error:
            continue
        rx = ct._Regex(pattern)
        for name in names + ["".join(rng.choice("ab.0x\n") for _ in range(rng.randrange(7))) for _ in range(4)]:
            assert rx.match(name, ct._Budget()) == (compiled.match(name) is not None), (pattern, name)
            compared += 1
    assert compared >= 5000


def test_a_catastrophic_pattern_costs_steps_linear_in_the_name():
    name = "model.layers.0.self_attn.q_proj." * 100  # 3,200 characters: Python's re would take ages
    for pattern in (r"([\w.]+)+X", r"(a|a)*X", r".*.*.*.*.*.*.*.*.*.*X", r"(\w+\.)+\w+X"):
        budget = ct._Budget()
        assert not ct._Regex(pattern).match(name, budget)
        assert ct.MATCH_MAX_STEPS - budget.left <= 2 * len(name) + 200, pattern
    assert re.match(r"([\w.]+)+X", "model.q") is None  # what re says on a name short enough to ask it


def test_catastrophic_target_in_a_checkpoint_reads_in_bounded_work(tmp_path):
    """Two groups, so the re: target is tried on every quantized layer (the other group names them exactly)."""
    long = "model.layers.0.self_attn." * 40 + "q_proj"
    tensors = {**pack_quantized_entries(long, CODES, SCALE, None, 4, True),
               **pack_quantized_entries("short", CODES, SCALE, None, 4, True)}
    folder = write(tmp_path / "ck", tensors, qc_of({"slow": group([r"re:([\w.]+)+X"]), "named": group([long, "short"])}))
    load_compressed_tensors(folder)  # warm
    with LineCounter() as counter:
        out = load_compressed_tensors(folder)
    np.testing.assert_array_equal(out[f"{long}.weight"], expected_quantized()["p.weight"])
    assert counter.lines < 40 * len(long) + 20_000, counter.lines


def test_re_targets_outside_the_subset_are_refused(tmp_path):
    folder = quantized_sparse(tmp_path / "ck")
    cfg = os.path.join(folder, "config.json")
    supported = ("(supported: literals, '.', classes, groups, '|', quantifiers * + ? {m,n}, '^', '$', '\\A' and "
                 "'\\Z')")
    cases = [
        (r"(a)\1", f"re: target '(a)\\\\1' uses a backreference, which this reader does not match {supported}"),
        ("(?=p)", f"re: target '(?=p)' uses '(?=' (lookarounds, inline flags, comments, atomic groups and "
                  f"backreferences are not supported; supported: {supported[12:]}"),
        ("(?i)p", f"re: target '(?i)p' uses '(?i' (lookarounds, inline flags, comments, atomic groups and "
                  f"backreferences are not supported; supported: {supported[12:]}"),
        (r"\bp", f"re: target '\\\\bp' uses '\\b', which this reader does not match {supported}"),
        ("(p{100}){100}", "re: target '(p{100}){100}' needs more than 4,000 automaton states (its {m,n} repeats copy "
                          "their body)"),
        ("p" * 1001, f"re: target {'p' * 100!r}... is 1,001 characters long (at most 1,000)"),
        ("(p", "re: target '(p' is not a valid regular expression (missing ), unterminated subpattern at position 0)"),
    ]
    if sys.version_info >= (3, 11):
        cases.append(("p*+", f"re: target 'p*+' uses a possessive quantifier, which this reader does not match "
                             f"{supported}"))
    for pattern, message in cases:
        rewrite(folder, config=lambda qc, p=pattern: qc["config_groups"]["g0"].update(targets=["re:" + p]))
        assert refused(folder) == f"{cfg!r}: {message}", pattern


def test_matching_stops_at_its_step_budget(tmp_path, monkeypatch):
    long = "m." * 600 + "q"
    tensors = {**pack_quantized_entries(long, CODES, SCALE, None, 4, True)}
    folder = write(tmp_path / "ck", tensors, qc_of({"a": group([r"re:(m\.)*x"]), "b": group([long])}))
    np.testing.assert_array_equal(load_compressed_tensors(folder)[f"{long}.weight"], expected_quantized()["p.weight"])
    monkeypatch.setattr(ct, "MATCH_MAX_STEPS", 1000)
    assert refused(folder) == (f"{os.path.join(folder, 'config.json')!r}: matching the re: targets against the layer "
                               f"names takes more than 1,000 automaton steps (MATCH_MAX_STEPS); use fewer or simpler "
                               f"targets")


# ------------------------------------------------------------------------------------------ caps
def test_a_header_of_many_empty_tensors_is_refused_before_it_is_read(tmp_path):
    """The issue's 93 MB header of 1.6 M empty tensors, scaled down: more than 1 MiB + a quarter of the data."""
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(60_000)}
    text = json.dumps(header).encode()
    folder = tmp_path / "ck"
    folder.mkdir()
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    (folder / "config.json").write_text("{}")
    refused(str(folder))  # warm
    tracemalloc.start()
    with pytest.raises(CheckpointError) as e:
        load_compressed_tensors(folder)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(e.value) == (f"{str(path)!r}: safetensors header of {len(text):,} bytes for 0 bytes of tensor data, "
                            f"more than the 1,048,576 allowed (1,048,576 + a quarter of the data: a real header takes "
                            f"~100 bytes per tensor)")
    assert peak < 64 << 10, peak  # the header was never read
    text = json.dumps({"w": {"dtype": "F32", "shape": [1] * 33, "data_offsets": [0, 4]}}).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(4))
    assert refused(str(folder)) == f"{str(path)!r}: tensor 'w': shape of 33 axes (at most 32)"


def test_the_decoded_size_is_capped_before_anything_is_decoded(tmp_path, monkeypatch):
    """The issue's 4 MiB 1-bit file: 128 MiB of float32 weights, over 32 MiB + 16x its 4 MiB."""
    out, cols = 1024, 32768
    tensors = {"l.weight_packed": np.zeros((out, cols // 32), np.int32), "l.weight_scale": np.ones((out, 1), np.float32),
               "l.weight_shape": np.array([out, cols], np.int64)}
    folder = write(tmp_path / "onebit", tensors, qc_of({"g": group(["l"], bits=1, gs=None)}))
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    assert size == 4_198_704
    refused(folder)  # warm
    tracemalloc.start()
    with pytest.raises(CheckpointError) as e:
        checkpoint_report(folder)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert str(e.value) == (f"{folder!r}: its weights decode to 134,217,728 bytes, more than the 100,733,696 this reader "
                            f"decodes from 4,198,704 bytes of files (33,554,432 + 16x the files; pass max_bytes= or set "
                            f"COMPRESSOR_MAX_DECODED_BYTES to read it)")
    assert peak < 256 << 10, peak  # refused from the headers: nothing decoded, the file never read
    assert decoded_cap(size) == 100_733_696 and decoded_cap(size, 5) == 5
    # the cap is the caller's to raise: exactly the decoded bytes pass, one less is refused
    small = quantized_sparse(tmp_path / "small")
    decoded = sum(v.nbytes for v in expected_quantized().values())
    assert decoded == 288
    assert sorted(load_compressed_tensors(small, max_bytes=decoded)) == sorted(expected_quantized())
    with pytest.raises(CheckpointError, match=r"its weights decode to 288 bytes, more than the 287 this reader"):
        load_compressed_tensors(small, max_bytes=decoded - 1)
    monkeypatch.setenv("COMPRESSOR_MAX_DECODED_BYTES", "287")
    with pytest.raises(CheckpointError, match=r"its weights decode to 288 bytes, more than the 287 this reader"):
        checkpoint_report(small)
    monkeypatch.setenv("COMPRESSOR_MAX_DECODED_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"COMPRESSOR_MAX_DECODED_BYTES='lots' is not an integer number of bytes"):
        checkpoint_report(small)
    with pytest.raises(ConfigError, match=r"max_bytes must be a non-negative int or None, got -1"):
        load_compressed_tensors(small, max_bytes=-1)


def test_files_are_mapped_and_decoded_a_chunk_at_a_time(tmp_path):
    """Loading holds the decoded weights plus a chunk's work (the files are mapped, not read or copied); the
    report holds no weights at all."""
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB as stored and as decoded
    codes = rng.integers(-8, 8, size=(1024, 4096))
    scale = rng.random((1024, 32)).astype(np.float32) + 0.5
    tensors = {**pack_quantized_entries("q", codes, scale, None, 4, True), "emb.weight": dense}
    folder = write(tmp_path / "ck", tensors, qc_of({"g": group(["q"], gs=128)}))
    load_compressed_tensors(folder)  # warm
    weights = 4 * 1024 * 1024 + 4 * 1024 * 4096  # 20 MiB decoded
    tracemalloc.start()
    out = load_compressed_tensors(folder)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert sum(v.nbytes for v in out.values()) == weights
    assert weights < peak < weights + (8 << 20), peak  # reading the 6 MiB file whole and copying it: 12 MiB more
    np.testing.assert_array_equal(out["emb.weight"], dense)
    np.testing.assert_array_equal(out["q.weight"], (codes * np.repeat(scale, 128, axis=1)).astype(np.float32))
    tracemalloc.start()
    rep = checkpoint_report(folder)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, peak
    assert [r["layer"] for r in rep["layers"]] == ["emb.weight", "q.weight"]
    assert rep["layers"][1]["sparsity"] == float(np.mean(codes == 0))


def test_chunked_decoding_equals_whole_decoding(tmp_path, monkeypatch):
    """Tiny chunks split rows and columns (at multiples of 32 codes: a packed word of any width starts there)."""
    rng = np.random.default_rng(1)
    out, cols = 7, 100
    codes = rng.integers(0, 8, size=(out, cols))
    zp = rng.integers(0, 8, size=(out, 4))
    scale = rng.random((out, 4)).astype(np.float16) + 0.5
    weight = rng.standard_normal((5, 40)).astype(np.float32) * (rng.random((5, 40)) < 0.3)
    bf16 = (rng.standard_normal((3, 50)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    tensors = {**pack_quantized_entries("q", codes, scale, zp, 3, False, np.float16), **bitmask_entries("s", weight)}
    folder = write(tmp_path / "ck", tensors, qc_of({"g": group(["q"], bits=3, gs=25, sym=False)}, "sparse-bitmask"))
    write_safetensors(os.path.join(folder, "model.safetensors"), {**tensors, "b": bf16}, bf16={"b"})
    whole = load_compressed_tensors(folder)
    monkeypatch.setattr(ct, "CHUNK", 40)
    pieces = load_compressed_tensors(folder)
    g = np.repeat(scale.astype(np.float32), 25, axis=1)
    want = {"q.weight": ((codes - np.repeat(zp, 25, axis=1)) * g).astype(np.float16), "s.weight": weight,
            "b": (bf16.astype(np.uint32) << 16).view(np.float32)}
    for got in (whole, pieces):
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k


# ------------------------------------------------------------------------------------------ files
def test_files_that_are_not_regular_files_are_refused_before_reading(tmp_path):
    folder = quantized_sparse(tmp_path / "ck")
    path = os.path.join(folder, "model.safetensors")
    os.remove(path)
    if os.path.exists("/proc/self/mem"):
        os.symlink("/proc/self/mem", path)  # a 'regular' file of 0 bytes whose reads fail
        assert refused(folder) == f"{path!r}: truncated safetensors file (0 bytes, no header length)"
        os.remove(path)
    not_regular = "the safetensors file is not a regular file (a directory, FIFO, socket or device); a checkpoint's " \
                  "files must be regular files"
    if hasattr(os, "mkfifo"):
        os.mkfifo(path)  # opening it would block
        assert refused(folder) == f"{path!r}: {not_regular}"
        os.remove(path)
    os.mkdir(path)
    assert refused(folder) == f"{path!r}: {not_regular}"
    os.rmdir(path)
    os.symlink(os.path.join(folder, "gone"), path)
    assert refused(folder) == f"{path!r}: cannot read the safetensors file (No such file or directory)"
    os.remove(path)
    cfg = os.path.join(folder, "config.json")
    os.remove(cfg)
    os.mkdir(cfg)
    assert refused(folder) == (f"{cfg!r}: config.json is not a regular file (a directory, FIFO, socket or device); a "
                               f"checkpoint's files must be regular files")


# ------------------------------------------------------------------------------------------ fuzz
def damage(folder: str, rng: random.Random) -> str:
    """One damage: a tensor dropped, renamed or cast to another dtype, or a config value replaced."""
    path = os.path.join(folder, "model.safetensors")
    tensors = read_safetensors(path)
    kind = rng.randrange(4)
    name = rng.choice(sorted(tensors))
    if kind == 0:
        del tensors[name]
    elif kind == 1:
        tensors[name + rng.choice(["s", "_x"])] = tensors.pop(name)
    elif kind == 2:
        with np.errstate(invalid="ignore", over="ignore"):
            tensors[name] = tensors[name].astype(rng.choice([np.int8, np.uint8, np.int16, np.int32, np.int64,
                                                             np.float16, np.float32, np.float64]))
    if kind < 3:
        write_safetensors(path, tensors)
        return f"{kind}:{name}"
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    weights = cfg["quantization_config"]["config_groups"][rng.choice(["g0", "g1", "g2"])]["weights"]
    key = rng.choice(["symmetric", "num_bits", "group_size", "strategy", "dynamic", "actorder", "type"])
    weights[key] = rng.choice([None, True, False, 0, 1, 2, 4, 8, "false", "true", "4", "group", "channel", 4.0])
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return f"config {key}={weights[key]!r}"


def test_fuzz_damaged_checkpoints_never_read_as_wrong_weights(tmp_path):
    """Fixed seed: every damaged checkpoint is refused, or reads to the undamaged weights (those it still
    holds: a dropped float tensor, a dtype change that keeps the values), never to other values."""
    want = expected_quantized()
    rng = random.Random(45)
    outcomes: dict[str, int] = {}
    for i in range(120):
        folder = quantized_sparse(tmp_path / f"c{i}")
        what = damage(folder, rng)
        try:
            got = load_compressed_tensors(folder)
        except CheckpointError:
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            continue
        outcomes["read"] = outcomes.get("read", 0) + 1
        for k, v in got.items():
            ref = want.get(k)
            if ref is None:  # a renamed or cast plain tensor comes back as stored
                assert k.startswith("emb.weight"), (what, k)
                continue
            # the same values (a scale or value tensor cast to another float dtype decodes in that dtype)
            assert np.array_equal(v.astype(np.float64), ref.astype(np.float64)), (what, k)
            assert v.dtype == ref.dtype or what.startswith("2:"), (what, k)
    assert outcomes["refused"] >= 60 and outcomes.get("read", 0) >= 5, outcomes
