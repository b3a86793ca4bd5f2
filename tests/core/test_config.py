import warnings

import pytest

from compressor import ConfigError, load_config, load_configs, normalize_config_list
from compressor.core.config import key_spec


def norm(cfg, **kw):
    return normalize_config_list(cfg, **kw)


def test_normalises_and_does_not_modify_input():
    cfg = [{"sparsity": 0.5, "op_types": ["Conv2d"]}]
    out = norm(cfg)
    assert out == [{"sparsity": 0.5, "op_types": ["Conv2d"], "exclude": False}]
    assert cfg == [{"sparsity": 0.5, "op_types": ["Conv2d"]}]
    out[0]["op_types"].append("x")
    assert cfg[0]["op_types"] == ["Conv2d"]


def test_quant_bits_int_expands_to_dict_per_type():
    out = norm([{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["default"]}])
    assert out[0]["quant_bits"] == {"weight": 8, "output": 8}


def test_quant_bits_dict_implies_quant_types():
    out = norm([{"quant_bits": {"weight": 4}, "op_types": ["Linear"]}])
    assert out[0]["quant_types"] == ["weight"] and out[0]["quant_bits"] == {"weight": 4}


@pytest.mark.parametrize(
    "entry, key, allowed",
    [
        ({"sparsity": 1.0, "op_types": ["default"]}, "'sparsity' = 1.0", "0 <= sparsity < 1"),
        ({"sparsity": -0.1, "op_types": ["default"]}, "'sparsity' = -0.1", "0 <= sparsity < 1"),
        ({"sparsity": "0.5", "op_types": ["default"]}, "'sparsity' = '0.5'", "0 <= sparsity < 1"),
        ({"sparsity": True, "op_types": ["default"]}, "'sparsity' = True", "0 <= sparsity < 1"),
        ({"sparsity": 0.5, "op_types": "Conv2d"}, "'op_types' = 'Conv2d'", "list of layer type names"),
        ({"sparsity": 0.5, "op_types": []}, "'op_types' = []", "non-empty list"),
        ({"sparsity": 0.5, "op_names": [1]}, "'op_names' = [1]", "list of layer names"),
        ({"sparsity": 0.5, "op_types": ["default"], "exclude": "yes"}, "'exclude' = 'yes'", "True"),
        ({"quant_types": ["weight"], "quant_bits": 33, "op_types": ["default"]}, "'quant_bits' = 33", "1..32"),
        ({"quant_types": ["weight"], "quant_bits": 0, "op_types": ["default"]}, "'quant_bits' = 0", "1..32"),
        ({"quant_types": ["weights"], "quant_bits": 8, "op_types": ["default"]}, "'quant_types' = ['weights']",
         "['weight', 'input', 'output']"),
        ({"quant_types": ["weight"], "quant_bits": {"weight": 8, "bias": 8}, "op_types": ["default"]},
         "'quant_bits'", "dict {quant_type"),
        ({"quant_types": ["weight"], "quant_bits": 8, "quant_start_step": -1, "op_types": ["default"]},
         "'quant_start_step' = -1", "int >= 0"),
        ({"final_sparsity": 0.5, "start_epoch": 1.5, "op_types": ["default"]}, "'start_epoch' = 1.5", "int >= 0"),
        ({"final_sparsity": 0.5, "end_epoch": -2, "op_types": ["default"]}, "'end_epoch' = -2", "int >= 0"),
        ({"final_sparsity": 0.5, "frequency": 0, "op_types": ["default"]}, "'frequency' = 0", "int > 0"),
        ({"initial_sparsity": 0.6, "final_sparsity": 0.5, "op_types": ["default"]}, "'initial_sparsity' = 0.6",
         "<= final_sparsity (0.5)"),
    ],
)
def test_bad_values_name_index_key_value_and_allowed(entry, key, allowed):
    cfg = [{"sparsity": 0.1, "op_types": ["default"]}, entry]
    with pytest.raises(ConfigError) as ei:
        norm(cfg)
    msg = str(ei.value)
    assert msg.startswith("config_list[1]: ")
    assert key in msg and allowed in msg


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_key_did_you_mean():
    with pytest.raises(ConfigError, match=r"config_list\[0\]: unknown key 'sparsty' \(did you mean 'sparsity'\?\)"):
        norm([{"sparsty": 0.5, "op_types": ["default"]}])
    with pytest.raises(ConfigError, match=r"unknown key 'op_type' \(did you mean 'op_types'\?\)"):
        norm([{"sparsity": 0.5, "op_type": ["default"]}])


def test_op_types_or_op_names_required():
    with pytest.raises(ConfigError, match=r"config_list\[0\]: names no layers; give 'op_types'"):
        norm([{"sparsity": 0.5}])


def test_required_keys_per_algorithm_except_excluded():
    with pytest.raises(ConfigError, match=r"config_list\[0\]: LevelPruner needs key\(s\) \['sparsity'\]"):
        norm([{"op_types": ["default"]}], required=["sparsity"], what="LevelPruner")
    out = norm([{"sparsity": 0.5, "op_types": ["default"]}, {"op_names": ["fc"], "exclude": True}], required=["sparsity"])
    assert out[1] == {"op_names": ["fc"], "exclude": True}


def test_not_a_list():
    with pytest.raises(ConfigError, match="must be a list of dicts"):
        norm({"sparsity": 0.5, "op_types": ["default"]})
    with pytest.raises(ConfigError, match="non-empty list"):
        norm([])
    with pytest.raises(ConfigError, match=r"config_list\[0\]: each entry must be a dict"):
        norm(["sparsity"])


def test_algorithm_keys_declared_by_name_or_spec():
    with pytest.raises(ConfigError, match="unknown key 'quant_scheme'"):
        norm([{"quant_types": ["weight"], "quant_bits": 8, "quant_scheme": "per_tensor_affine", "op_types": ["default"]}])
    out = norm([{"quant_types": ["weight"], "quant_bits": 8, "quant_scheme": "per_channel_symmetric",
                 "op_types": ["default"]}], extra_keys=["quant_scheme"])
    assert out[0]["quant_scheme"] == "per_channel_symmetric"

    def even(v):
        if not isinstance(v, int) or v % 2:
            raise ValueError
        return v

    spec = key_spec("blocks", even, "an even int")
    assert norm([{"blocks": 4, "op_types": ["default"]}], extra_keys=[spec])[0]["blocks"] == 4
    with pytest.raises(ConfigError, match=r"'blocks' = 3 is invalid; allowed: an even int"):
        norm([{"blocks": 3, "op_types": ["default"]}], extra_keys=[spec])


def test_legacy_keys_map_with_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="support_type"):
        out = norm([{"sparsity": 0.8, "support_type": "default"}])
    assert out == [{"sparsity": 0.8, "op_types": ["default"], "exclude": False}]
    with pytest.warns(DeprecationWarning):
        out = norm([{"sparsity": 0.8, "support_type": ["Linear"], "support_op": ["conv1", "conv2"], "prune": False}])
    assert out == [{"sparsity": 0.8, "op_types": ["Linear"], "op_names": ["conv1", "conv2"], "exclude": True}]
    with pytest.warns(DeprecationWarning):
        out = norm([{"sparsity": 0.8, "support_layer": "default", "prune": True}])
    assert out[0]["exclude"] is False and out[0]["op_types"] == ["default"]


def test_legacy_conflict_is_an_error():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match="only one of 'support_type' and 'op_types'"):
            norm([{"sparsity": 0.8, "support_type": ["Linear"], "op_types": ["Conv2d"]}])


def test_exclude_false_does_not_exclude():
    out = norm([{"sparsity": 0.5, "op_types": ["default"], "exclude": False}])
    assert out[0]["exclude"] is False


SEED_004_YAML = """
tfAGPruner:
  config:
    -
        start_epoch: 0
        end_epoch: 16
        frequency: 2
        initial_sparsity: 0.05
        final_sparsity: 0.60
        support_type: default
    -
        prune: False
        start_epoch: 0
        end_epoch: 20
        frequency: 2
        initial_sparsity: 0.05
        final_sparsity: 0.60
        support_type: [Linear]
        support_op: [conv1, conv2]
"""


def test_load_seed_004_yaml(tmp_path):
    p = tmp_path / "agp.yaml"
    p.write_text(SEED_004_YAML)
    raw = load_config(p)
    assert load_configs(p).keys() == {"tfAGPruner"}
    with pytest.warns(DeprecationWarning):
        cfg = normalize_config_list(raw)
    assert cfg[0] == {"start_epoch": 0, "end_epoch": 16, "frequency": 2, "initial_sparsity": 0.05,
                      "final_sparsity": 0.6, "op_types": ["default"], "exclude": False}
    assert cfg[1]["exclude"] is True and cfg[1]["op_names"] == ["conv1", "conv2"] and cfg[1]["op_types"] == ["Linear"]


def test_load_bare_list_and_sections(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("- {sparsity: 0.5, op_types: [default]}\n")
    assert load_config(p) == [{"sparsity": 0.5, "op_types": ["default"]}]
    q = tmp_path / "two.yaml"
    q.write_text("A: {config: [{sparsity: 0.1, op_types: [default]}]}\nB: [{sparsity: 0.2, op_types: [default]}]\n")
    assert load_config(q, "B") == [{"sparsity": 0.2, "op_types": ["default"]}]
    with pytest.raises(ConfigError, match=r"several sections \['A', 'B'\]; pass algorithm=NAME"):
        load_config(q)
    with pytest.raises(ConfigError, match=r"has no section 'C'; sections: \['A', 'B'\]"):
        load_config(q, "C")


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "s.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="must hold a list of dicts or a mapping"):
        load_config(scalar)
    sec = tmp_path / "sec.yaml"
    sec.write_text("A: {config: [], other: 1}\n")
    with pytest.raises(ConfigError, match=r"section 'A' must hold only 'config: \[...\]'"):
        load_config(sec)


def test_yaml_is_loaded_safely(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("- !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
