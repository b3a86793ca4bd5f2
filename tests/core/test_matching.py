import warnings

import pytest

from compressor import ConfigError, ConfigWarning, normalize_config_list
from compressor.core.matching import LayerInfo, match_layers, type_names

TORCH_DEFAULT = ("Conv2d", "Linear")
LAYERS = [LayerInfo("conv1", "Conv2d"), LayerInfo("bn1", "BatchNorm2d"), LayerInfo("conv2", "Conv2d"),
          LayerInfo("fc1", "Linear"), LayerInfo("fc2", "Linear")]


def m(cfg, layers=LAYERS, default=TORCH_DEFAULT, **kw):
    return [(layer.name, c.get("sparsity")) for layer, c in match_layers(layers, normalize_config_list(cfg), default, **kw)]


def test_default_expands_to_weighted_types():
    assert m([{"sparsity": 0.5, "op_types": ["default"]}]) == [("conv1", 0.5), ("conv2", 0.5), ("fc1", 0.5), ("fc2", 0.5)]


def test_last_matching_entry_wins():
    cfg = [{"sparsity": 0.5, "op_types": ["default"]}, {"sparsity": 0.9, "op_names": ["conv2"]},
           {"sparsity": 0.1, "op_types": ["Linear"]}]
    assert m(cfg) == [("conv1", 0.5), ("conv2", 0.9), ("fc1", 0.1), ("fc2", 0.1)]
    cfg.reverse()
    assert m(cfg) == [("conv1", 0.5), ("conv2", 0.5), ("fc1", 0.5), ("fc2", 0.5)]


def test_exclude_true_removes_and_exclude_false_keeps():
    cfg = [{"sparsity": 0.5, "op_types": ["default"]}, {"op_names": ["fc2"], "exclude": True}]
    assert m(cfg) == [("conv1", 0.5), ("conv2", 0.5), ("fc1", 0.5)]
    cfg = [{"sparsity": 0.5, "op_types": ["default"]}, {"sparsity": 0.3, "op_names": ["fc2"], "exclude": False}]
    assert m(cfg)[-1] == ("fc2", 0.3)


def test_op_types_and_op_names_both_must_match():
    assert m([{"sparsity": 0.5, "op_types": ["Linear"], "op_names": ["conv1", "fc1"]}]) == [("fc1", 0.5)]


def test_other_backend_type_names_are_accepted():
    keras_layers = [LayerInfo("conv", "Conv2D"), LayerInfo("bn", "BatchNormalization"), LayerInfo("dense", "Dense")]
    assert m([{"sparsity": 0.5, "op_types": ["Conv2d", "Linear"]}], keras_layers, ("Conv2D", "Dense")) == [
        ("conv", 0.5), ("dense", 0.5)]
    assert m([{"sparsity": 0.5, "op_types": ["BatchNorm2d"]}], keras_layers, ("Conv2D", "Dense")) == [("bn", 0.5)]
    assert m([{"sparsity": 0.5, "op_types": ["Conv2D", "BatchNormalization"]}]) == [("conv1", 0.5), ("bn1", 0.5),
                                                                                  ("conv2", 0.5)]


def test_rank_specific_batchnorm_does_not_match_other_rank():
    assert "BatchNorm1d" not in type_names("BatchNorm2d")
    assert {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d"} <= type_names("BatchNormalization")


def test_unmatched_names_warn_naming_them():
    with pytest.warns(ConfigWarning, match=r"config_list\[1\]: op_names \['conv9'\] match no layer"):
        m([{"sparsity": 0.5, "op_types": ["default"]}, {"sparsity": 0.2, "op_names": ["conv9"]}])
    with pytest.warns(ConfigWarning, match=r"op_types \['LSTM'\] match no layer"):
        m([{"sparsity": 0.5, "op_types": ["default", "LSTM"]}])


def test_no_layer_selected_is_an_error_listing_types():
    with pytest.warns(ConfigWarning):
        with pytest.raises(ConfigError, match=r"selects no layer of the model. Layer types in the model: "
                                              r"\['BatchNorm2d', 'Conv2d', 'Linear'\]"):
            m([{"sparsity": 0.5, "op_types": ["LSTM"]}])
    assert m([{"sparsity": 0.5, "op_types": ["default"]}, {"op_types": ["default"], "exclude": True}],
             require_match=False) == []


def test_a_subclass_that_keeps_its_base_computation_matches_as_the_base():
    """HF EfficientNet's depthwise convs are ``EfficientNetDepthwiseConv2d(nn.Conv2d)``: 'default' and
    'Conv2d' select them (the backend lists the base in ``bases``), their own type name does too."""
    layers = [LayerInfo("dw", "EfficientNetDepthwiseConv2d", bases=("Conv2d",)), LayerInfo("own", "MyConv"),
              LayerInfo("fc", "Linear")]
    assert m([{"sparsity": 0.5, "op_types": ["default"]}], layers) == [("dw", 0.5), ("fc", 0.5)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no 'match no layer' warning: Conv2D matches dw
        assert m([{"sparsity": 0.5, "op_types": ["Conv2D"]}], layers) == [("dw", 0.5)]
    assert m([{"sparsity": 0.5, "op_types": ["EfficientNetDepthwiseConv2d"]}], layers) == [("dw", 0.5)]
