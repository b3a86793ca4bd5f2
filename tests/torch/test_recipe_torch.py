"""Recipes of the streaming one-shot command on torch: names resolve to compressor.torch's classes, and each
stage is checked as the class checks its config_list (the same normalised entries, the same refusals)."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

import compressor.torch as ct
from compressor.core.errors import ConfigError
from compressor.core.recipe import load_recipe, recipe_hash
from tests.core.test_recipe import CONFIG_CASES, TWO_STAGES


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, 8)

    def forward(self, x):
        return self.lm_head(self.fc(x))


def _build(stage_cls, config_list):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return stage_cls(_Tiny(), config_list)


def test_the_two_stage_example_resolves_to_the_torch_classes_with_their_normalised_configs(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(TWO_STAGES)
    stages = load_recipe(path, "torch", what="--recipe")
    assert [(s.name, s.cls) for s in stages] == [("SparseGPTPruner", ct.SparseGPTPruner),
                                                   ("GptqQuantizer", ct.GptqQuantizer)]
    assert stages[0].config_list == [{"sparse_pattern": "2:4", "op_types": ["Linear"]}]
    assert stages[0].normalized == [{"sparse_pattern": "2:4", "op_types": ["Linear"], "exclude": False,
                                     "sparsity": 0.5}]
    assert stages[1].config_list == [{"quant_types": ["weight"], "quant_bits": 4, "group_size": 128,
                                      "op_types": ["Linear"]}, {"op_names": ["lm_head"], "exclude": True}]
    assert stages[1].normalized == [{"quant_types": ["weight"], "quant_bits": {"weight": 4}, "group_size": 128,
                                     "op_types": ["Linear"], "exclude": False},
                                    {"op_names": ["lm_head"], "exclude": True, "quant_types": ["weight"]}]
    for s in stages:  # what the class itself makes of the user's entries
        assert _build(s.cls, s.config_list).config_list == s.normalized
    # a file, a string and a parsed list are the same recipe
    assert recipe_hash(stages) == recipe_hash(load_recipe(TWO_STAGES, "torch"))
    import yaml

    parsed = yaml.safe_load(TWO_STAGES)
    again = load_recipe(parsed, "torch")
    assert recipe_hash(again) == recipe_hash(stages)
    assert again[1].config_list == parsed[1]["GptqQuantizer"] and again[1].config_list is not parsed[1]["GptqQuantizer"]
    again[1].config_list[0]["quant_bits"] = 8  # copies: the caller's list is not aliased
    assert parsed[1]["GptqQuantizer"][0]["quant_bits"] == 4


@pytest.mark.parametrize("name", ["WandaPruner", "SparseGPTPruner", "GptqQuantizer", "RtnQuantizer", "AwqQuantizer"])
def test_every_one_shot_algorithm_loads_and_matches_its_class(name):
    entry = ({"sparsity": 0.5, "op_types": ["Linear"]} if name.endswith("Pruner")
             else {"quant_bits": 4, "group_size": 8, "quant_scheme": "affine", "op_types": ["Linear"]})
    (stage,) = load_recipe([{name: [entry, {"op_names": ["lm_head"], "exclude": True}]}], "torch")
    assert stage.cls is getattr(ct, name)
    assert _build(stage.cls, stage.config_list).config_list == stage.normalized


@pytest.mark.parametrize("recipe,message", CONFIG_CASES, ids=[c[0][2:30] for c in CONFIG_CASES])
def test_a_bad_stage_is_refused_as_its_class_refuses_it(recipe, message):
    import yaml

    (stage,) = yaml.safe_load(recipe)
    ((name, config_list),) = stage.items()
    with pytest.raises(ConfigError) as info:
        load_recipe("- RtnQuantizer: [{quant_bits: 4, op_types: [Linear]}]\n" + recipe, "torch")
    assert str(info.value) == f"recipe: stage 1 ({name}): {message}"
    with pytest.raises(ConfigError):
        _build(getattr(ct, name), config_list)
