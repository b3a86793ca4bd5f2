"""Recipes of the streaming one-shot command (compressor/core/recipe.py): structure errors, the names a recipe
may use, and the recipe's hash. No framework: every case here is refused before the backend's classes are
imported. The stages' config checks (which need the classes' keys) are in tests/torch/test_recipe_torch.py
and tests/tf/test_recipe_tf.py, which share :data:`CONFIG_CASES` below."""

from __future__ import annotations

import hashlib
import json

import pytest

from compressor.core.errors import ConfigError
from compressor.core.recipe import ONESHOT_ALGORITHMS, RECIPE_EXAMPLE, RecipeStage, load_recipe, recipe_hash

TWO_STAGES = """\
- SparseGPTPruner: [{sparse_pattern: '2:4', op_types: [Linear]}]
- GptqQuantizer: [{quant_types: [weight], quant_bits: 4, group_size: 128, op_types: [Linear]}, {op_names: [lm_head], exclude: true}]
"""
ALLOWED = "WandaPruner, SparseGPTPruner, GptqQuantizer, RtnQuantizer, AwqQuantizer"

#: (recipe, the stage's error after 'recipe: stage 0 (NAME): ') for both backends: the checks each class runs
CONFIG_CASES = [
    ("- WandaPruner: [{op_types: [Linear]}]",
     "config_list[0]: without 'sparse_pattern' (e.g. '2:4'), WandaPruner needs key(s) ['sparsity'] in every "
     "non-excluded entry"),
    ("- WandaPruner: [{sparsity: 1.5, op_types: [Linear]}]",
     "config_list[0]: 'sparsity' = 1.5 is invalid; allowed: a number with 0 <= sparsity < 1"),
    ("- SparseGPTPruner: [{sparse_pattern: '4:2', op_types: [Linear]}]",
     "config_list[0]: 'sparse_pattern' = '4:2' is invalid; allowed: a string 'N:M' with integers 1 <= N < M, "
     "e.g. '2:4' (keep the N largest |w| of every M consecutive weights along the layer's input axis)"),
    ("- SparseGPTPruner: [{sparsity: 0.5, op_types: [Linear], damp: 2}]",
     "config_list[0]: 'damp' = 2 is invalid; allowed: a number in [0, 1): the fraction of mean(diag(H)) added to "
     "the Hessian's diagonal"),
    ("- GptqQuantizer: [{quant_bits: 16, op_types: [Linear]}]",
     "config_list[0]: weight-only one-shot quantization takes quant_bits 2..8, got 16"),
    ("- GptqQuantizer: [{op_types: [Linear]}]",
     "config_list[0]: GptqQuantizer needs key(s) ['quant_bits'] in every non-excluded entry"),
    ("- RtnQuantizer: [{quant_types: [input], quant_bits: 4, op_types: [Linear]}]",
     "config_list[0]: RtnQuantizer quantizes weights only: quant_types must be ['weight'] (or left out), got "
     "['input']"),
    ("- RtnQuantizer: [{quant_bits: 4, op_types: [Linear], gruop_size: 32}]",
     "config_list[0]: unknown key 'gruop_size' (did you mean 'group_size'?); RtnQuantizer accepts: end_epoch, "
     "exclude, final_sparsity, frequency, group_size, initial_sparsity, op_names, op_types, quant_bits, "
     "quant_range, quant_scheme, quant_start_step, quant_types, sparsity, start_epoch"),
    ("- AwqQuantizer: [{quant_bits: 4, op_types: [Linear], group_size: 0}]",
     "config_list[0]: 'group_size' = 0 is invalid; allowed: a positive int (input columns per quantization "
     "group) or -1 / None (one group per output channel)"),
    ("- AwqQuantizer: [{quant_bits: 4}]",
     "config_list[0]: names no layers; give 'op_types' (e.g. ['default'], ['Conv2d']) and/or 'op_names' (e.g. "
     "['conv1'])"),
    ("- RtnQuantizer: []", "config_list: config_list must be a non-empty list of dicts, got []"),
]


def _error(source, backend: str = "torch", what: str = "recipe") -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(source, backend, what=what)
    return str(info.value)


# ----------------------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("source,message", [
    ("[]", "recipe: no stages; "),
    ("", "recipe: no stages; "),
    ([], "recipe: no stages; "),
    ("{WandaPruner: [{sparsity: 0.5, op_types: [Linear]}]}", "recipe: expected a list of stages, got dict; "),
    ("- WandaPruner\n", "recipe: stage 0 is a str ('WandaPruner'), not a one-key mapping 'AlgorithmName: [config "
                        "entries]'; "),
    ("- {}\n", "recipe: stage 0 has 0 keys []; each stage is a mapping with exactly one key, the algorithm name "
               "(one stage per algorithm); "),
    ("- WandaPruner: [{sparsity: 0.5, op_types: [Linear]}]\n  RtnQuantizer: [{quant_bits: 4, op_types: [Linear]}]\n",
     "recipe: stage 0 has 2 keys ['WandaPruner', 'RtnQuantizer']; each stage is a mapping with exactly one key, "
     "the algorithm name (one stage per algorithm); "),
    ("- 3: []\n", "recipe: stage 0: the key 3 is not an algorithm name; "),
    ("- RtnQuantizer: [{quant_bits: 4, op_types: [Linear]}]\n- GptqQuantizer: {quant_bits: 4, op_types: [Linear]}\n",
     "recipe: stage 1 (GptqQuantizer): the config_list must be a list of dicts, got dict; "),
    ("- GptqQuantizer: [{quant_bits: 4,\n    op_types: [Linear]}\n- RtnQuantizer: []\n",
     "recipe: not valid YAML: line 3, column 1: expected ',' or ']', but got '-'; "),
    ("not_a_file", "recipe: 'not_a_file' is neither an existing file nor a YAML list of stages; "),
    (3, "recipe: expected a YAML file path, a YAML string or a list of stages, got int; "),
])
def test_a_recipe_that_is_not_a_list_of_one_key_stages_is_refused_with_an_example(source, message):
    assert _error(source) == message + RECIPE_EXAMPLE


def test_the_example_in_the_errors_is_a_valid_recipe_shape():
    assert RECIPE_EXAMPLE.endswith(
        "e.g.\n- SparseGPTPruner: [{sparse_pattern: '2:4', op_types: [Linear]}]\n"
        "- GptqQuantizer: [{quant_bits: 4, group_size: 128, op_types: [Linear]}, {op_names: [lm_head], exclude: true}]")


def test_yaml_errors_in_a_file_name_the_file_and_the_line(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("- RtnQuantizer: [{quant_bits: 4, op_types: [Linear]}]\n- GptqQuantizer: [{quant_bits: 4\n"
                    "- AwqQuantizer: []\n")
    assert _error(path, what="--recipe") == (f"--recipe {str(path)!r}: not valid YAML: line 3, column 15: expected "
                                             f"',' or '}}', but got ':'; " + RECIPE_EXAMPLE)
    assert _error(str(tmp_path / "missing.yaml"), what="--recipe") == (
        f"--recipe {str(tmp_path / 'missing.yaml')!r}: no such file")
    (tmp_path / "empty.yml").write_text("# nothing yet\n")
    assert _error(tmp_path / "empty.yml") == f"recipe {str(tmp_path / 'empty.yml')!r}: no stages; " + RECIPE_EXAMPLE


# --------------------------------------------------------------------------------------------------------- names
def test_only_the_one_shot_algorithms_can_be_streamed():
    assert list(ONESHOT_ALGORITHMS) == ALLOWED.split(", ")
    recipe = "- RtnQuantizer: [{quant_bits: 4, op_types: [Linear]}]\n- LevelPruner: [{sparsity: 0.5, op_types: [Linear]}]"
    for backend in ("torch", "tf"):  # refused before the backend is imported: no framework needed
        assert _error(recipe, backend) == (
            f"recipe: stage 1 (LevelPruner): LevelPruner is not a one-shot algorithm and cannot be streamed; a "
            f"recipe takes: {ALLOWED}")


@pytest.mark.parametrize("name,hint", [
    ("GPTQQuantizer", " (did you mean 'GptqQuantizer'?)"),
    ("SparseGptPruner", " (did you mean 'SparseGPTPruner'?)"),
    ("AWQ", ""),
    ("Wanda", " (did you mean 'WandaPruner'?)"),
])
def test_an_unknown_name_gets_a_hint_and_the_allowed_names(name, hint):
    assert _error(f"- {name}: [{{quant_bits: 4, op_types: [Linear]}}]") == (
        f"recipe: stage 0: no one-shot algorithm {name!r}{hint}; a recipe takes: {ALLOWED}")


def test_names_are_checked_in_every_stage_before_any_class_is_loaded():
    # stage 0 is fine, stage 1 misspelt: the error names stage 1 whatever the backend (even one not installed)
    recipe = [{"WandaPruner": [{"sparsity": 0.5, "op_types": ["Linear"]}]}, {"Gptq": []}]
    assert _error(recipe, "tf") == f"recipe: stage 1: no one-shot algorithm 'Gptq'; a recipe takes: {ALLOWED}"


def test_an_unknown_backend_is_refused():
    assert _error(TWO_STAGES, "jax") == "recipe: unknown backend 'jax'; one of ['tf', 'torch']"


# ---------------------------------------------------------------------------------------------------------- hash
def _stages(*pairs) -> list[RecipeStage]:
    return [RecipeStage(name, object, config_list, []) for name, config_list in pairs]


def test_the_hash_is_the_sha256_of_the_canonical_json_of_names_and_config_lists():
    stages = _stages(("SparseGPTPruner", [{"sparse_pattern": "2:4", "op_types": ["Linear"]}]),
                     ("GptqQuantizer", [{"quant_types": ["weight"], "quant_bits": 4, "group_size": 128,
                                         "op_types": ["Linear"]}, {"op_names": ["lm_head"], "exclude": True}]))
    text = ('[["SparseGPTPruner",[{"op_types":["Linear"],"sparse_pattern":"2:4"}]],'
            '["GptqQuantizer",[{"group_size":128,"op_types":["Linear"],"quant_bits":4,"quant_types":["weight"]},'
            '{"exclude":true,"op_names":["lm_head"]}]]]')
    assert json.loads(text) == [[s.name, s.config_list] for s in stages]
    assert recipe_hash(stages) == hashlib.sha256(text.encode()).hexdigest()
    # pinned: a resumed run compares it with the hash an earlier version of compressor stored
    assert recipe_hash(stages) == "11ce1ba038904b34eabba04062029a49f129e287dc4021ecf0312dd695fca49e"


def test_the_hash_ignores_key_order_and_tuples_but_not_values_order_or_wording():
    a = _stages(("RtnQuantizer", [{"quant_bits": 4, "op_types": ["Linear"], "group_size": 32}]))
    b = _stages(("RtnQuantizer", [{"group_size": 32, "op_types": ("Linear",), "quant_bits": 4}]))
    assert recipe_hash(a) == recipe_hash(b)
    assert recipe_hash(a) != recipe_hash(_stages(("RtnQuantizer", [{"quant_bits": 4, "op_types": ["Linear"],
                                                                   "group_size": 64}])))
    assert recipe_hash(a) != recipe_hash(_stages(("GptqQuantizer", a[0].config_list)))
    assert recipe_hash(a) != recipe_hash(_stages(("RtnQuantizer", [{"quant_bits": {"weight": 4},
                                                                   "op_types": ["Linear"], "group_size": 32}])))
    two = _stages(("WandaPruner", [{"sparsity": 0.5, "op_types": ["Linear"]}]), *[(s.name, s.config_list) for s in a])
    assert recipe_hash(two) != recipe_hash(two[::-1])
    assert recipe_hash([]) == hashlib.sha256(b"[]").hexdigest()


def test_the_hash_refuses_values_yaml_cannot_hold():
    with pytest.raises(ConfigError, match=r"recipe value \{1, 2\} \(set\) is not a YAML scalar, list or mapping"):
        recipe_hash(_stages(("WandaPruner", [{"op_names": {1, 2}}])))
