"""The framework-free quantizer base both TorchQuantizer and TfQuantizer inherit: declared defaults,
calling-style dispatch and the quant_types check, on plain Python values."""

import pytest

from compressor.core.errors import ConfigError
from compressor.core.quantizer import QuantizerBaseMixin, builtin_ste


class _Seed003(QuantizerBaseMixin):
    supported_quant_types = ("weight", "output")

    def __init__(self) -> None:
        self._read_method_styles()

    def quantize_weight(self, weight, config, **kwargs):  # seed 003 style: gets the config dict
        return {"w": weight, "bits": config["quant_bits"], "kw": sorted(kwargs)}

    @builtin_ste
    def quantize_output(self, output, wrapper, **kwargs):
        return output * 2


class _Wrapper:
    config = {"quant_bits": 8}
    name = "fc"
    type = "Linear"
    layer = "the layer"


def test_defaults_and_styles():
    assert QuantizerBaseMixin._kind == "quantizer"
    assert QuantizerBaseMixin.required_keys == ("quant_types", "quant_bits")
    assert QuantizerBaseMixin.supported_quant_types == ("weight", "input", "output")
    assert QuantizerBaseMixin.handles_start_step is False
    q = _Seed003()
    assert q._styles == {"input": ("wrapper", True), "weight": ("config", True), "output": ("wrapper", True)}
    assert q._autograd == {"input": None, "weight": None, "output": "ste"}


def test_call_method_dispatches_in_the_method_style():
    q = _Seed003()
    assert q._call_method("weight", 3, _Wrapper()) == {"w": 3, "bits": 8, "kw": ["op", "op_name", "op_type"]}
    assert q._call_method("output", 3, _Wrapper()) == 6
    with pytest.raises(NotImplementedError, match="_Seed003 must override quantize_input"):
        q._call_method("input", 3, _Wrapper())


def test_quant_types_check():
    q = _Seed003()
    q._check_quant_types("fc", ["weight", "output"])
    with pytest.raises(ConfigError, match=r"_Seed003: layer 'fc': quant_types \['input'\] are not supported; "
                                          r"_Seed003 quantizes \['weight', 'output'\]"):
        q._check_quant_types("fc", ["input"])
    q.supported_quant_types = ("input", "weight", "output")
    with pytest.raises(ConfigError, match=r"quant_types \['input'\] need quantize_input\(\), which _Seed003 does "
                                          r"not define"):
        q._check_quant_types("fc", ["weight", "input"])


def test_naive_rules_weights_and_8_bits_only():
    from types import SimpleNamespace

    from compressor.core.quantizer import NAIVE_QRANGE, NaiveQuantizerRules

    class Base:
        def validate_layer(self, layer_info, layer, config):
            self.seen = layer_info.name

    class Naive(NaiveQuantizerRules, Base):
        pass

    assert NAIVE_QRANGE == (-127, 127) and Naive.supported_quant_types == ("weight",)
    q = Naive()
    q.validate_layer(SimpleNamespace(name="fc"), None, {"quant_bits": {"weight": 8}})
    assert q.seen == "fc"
    with pytest.raises(ConfigError, match=r"NaiveQuantizer: layer 'fc': quant_bits = 4; NaiveQuantizer is 8-bit only "
                                          r"\(use QAT_Quantizer for other widths\)"):
        q.validate_layer(SimpleNamespace(name="fc"), None, {"quant_bits": {"weight": 4}})
