"""Recipes of the streaming one-shot command on Keras: names resolve to compressor.tf's classes, and each stage
is checked as the class checks its config_list (the same normalised entries, the same refusals)."""

from __future__ import annotations

import warnings

import pytest

keras = pytest.importorskip("keras")

import compressor.tf as ctf  # noqa: E402
from compressor.core.errors import ConfigError  # noqa: E402
from compressor.core.recipe import load_recipe, recipe_hash  # noqa: E402
from tests.core.test_recipe import CONFIG_CASES, TWO_STAGES  # noqa: E402

pytestmark = pytest.mark.tf


def _tiny():
    x = keras.Input((16,))
    return keras.Model(x, keras.layers.Dense(8, name="lm_head")(keras.layers.Dense(16, name="fc")(x)))


def _build(stage_cls, config_list):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return stage_cls(_tiny(), config_list)


def test_the_two_stage_example_resolves_to_the_keras_classes():
    stages = load_recipe(TWO_STAGES, "tf")
    assert [(s.name, s.cls) for s in stages] == [("SparseGPTPruner", ctf.SparseGPTPruner),
                                                   ("GptqQuantizer", ctf.GptqQuantizer)]
    assert stages[0].normalized == [{"sparse_pattern": "2:4", "op_types": ["Linear"], "exclude": False,
                                     "sparsity": 0.5}]
    assert stages[1].normalized == [{"quant_types": ["weight"], "quant_bits": {"weight": 4}, "group_size": 128,
                                     "op_types": ["Linear"], "exclude": False},
                                    {"op_names": ["lm_head"], "exclude": True, "quant_types": ["weight"]}]
    # the recipe's hash, not the backend's: the value tests/core/test_recipe.py pins
    assert recipe_hash(stages) == "11ce1ba038904b34eabba04062029a49f129e287dc4021ecf0312dd695fca49e"


@pytest.mark.parametrize("name", ["WandaPruner", "SparseGPTPruner", "GptqQuantizer", "RtnQuantizer", "AwqQuantizer"])
def test_every_one_shot_algorithm_loads_and_matches_its_class(name):
    entry = ({"sparsity": 0.5, "op_types": ["Dense"]} if name.endswith("Pruner")
             else {"quant_bits": 4, "group_size": 8, "quant_scheme": "affine", "op_types": ["Dense"]})
    (stage,) = load_recipe([{name: [entry, {"op_names": ["lm_head"], "exclude": True}]}], "tf")
    assert stage.cls is getattr(ctf, name)
    assert _build(stage.cls, stage.config_list).config_list == stage.normalized


@pytest.mark.parametrize("recipe,message", CONFIG_CASES, ids=[c[0][2:30] for c in CONFIG_CASES])
def test_a_bad_stage_is_refused_as_on_torch_and_by_its_class(recipe, message):
    import yaml

    (stage,) = yaml.safe_load(recipe)
    ((name, config_list),) = stage.items()
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, "tf")
    assert str(info.value) == f"recipe: stage 0 ({name}): {message}"
    dense = [{**e, "op_types": ["Dense"]} if isinstance(e, dict) and "op_types" in e else e for e in config_list]
    with pytest.raises(ConfigError):
        _build(getattr(ctf, name), dense)
