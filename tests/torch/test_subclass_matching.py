"""``'default'`` / ``'Linear'`` select ``nn.Linear`` subclasses that compute as a Linear (HF Falcon's
``FalconLinear``, whose own forward is ``x @ W.T + b``), in layer selection and in the N:M (2:4) checks; a
subclass that changes the computation is selected by its own name only. Falcon end to end: SparseGPT 2:4, the
compressed-tensors checkpoint, ``from_pretrained`` gives the in-memory logits."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from compressor.core.errors import ConfigError
from compressor.core.matching import DefaultSkipWarning
from compressor.torch import LevelPruner, PtqQuantizer, SparseGPTPruner
from compressor.torch.modules import torch_base_type


class MatmulLinear(nn.Linear):
    """As transformers' FalconLinear: its own forward, the same computation as nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class DoubledLinear(nn.Linear):
    """Its own forward that changes the result: not a Linear for 'default'."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class NeedsMask(nn.Linear):
    """A forward that cannot run as a Linear (an extra required argument): not a Linear for 'default'."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * mask


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), MatmulLinear(16, 16), nn.ReLU(), DoubledLinear(16, 8),
                         nn.ReLU(), MatmulLinear(8, 4, bias=False)).eval()


def test_base_type_is_linear_exactly_when_the_subclass_computes_as_one():
    m = _model()
    assert [torch_base_type(x) for x in m] == [None, None, "Linear", None, None, None, "Linear"]
    assert torch_base_type(NeedsMask(4, 4)) is None
    with torch.device("meta"):
        meta = MatmulLinear(4, 4)
    assert torch_base_type(meta) is None  # no weights to probe: selected by its own name only


@pytest.mark.parametrize("op_types", [["default"], ["Linear"], ["Dense"]])
def test_default_and_linear_select_the_subclass_that_computes_as_a_linear(op_types):
    model = _model()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        p = LevelPruner(model, [{"sparsity": 0.5, "op_types": op_types}])
    assert [w.name for w in p.get_modules_wrapper()] == ["0", "2", "6"]
    skipped = [str(w.message) for w in rec if issubclass(w.category, DefaultSkipWarning)]
    if op_types == ["default"]:
        assert len(skipped) == 1 and "DoubledLinear (1 layer" in skipped[0] and "MatmulLinear" not in skipped[0]


def test_the_changed_subclass_is_selected_by_its_own_name():
    model = _model()
    p = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["DoubledLinear"]}])
    assert [w.name for w in p.get_modules_wrapper()] == ["4"]


def test_2_4_applies_to_the_subclass_and_is_refused_on_a_layer_that_is_no_linear():
    model = _model()
    x = torch.randn(32, 8)
    p = SparseGPTPruner(model, [{"sparse_pattern": "2:4", "op_types": ["Linear"]}])
    p.calibrate([x], progress=False)
    for i in (0, 2, 6):
        w = model[i].module.weight.detach()
        nz = (w.reshape(w.shape[0], -1, 4) != 0).sum(-1)
        assert bool((nz == 2).all()), i
    model = nn.Sequential(nn.Linear(8, 8), NeedsMask(8, 8))
    with pytest.raises(ConfigError, match=r"layer '1' \(NeedsMask\) cannot take sparse_pattern '2:4'"):
        LevelPruner(model, [{"sparse_pattern": "2:4", "op_types": ["NeedsMask"]}])


def test_quantizer_runs_the_subclass_as_a_linear_and_keeps_its_output():
    model = _model()
    x = torch.randn(16, 8)
    with torch.no_grad():
        ref = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DefaultSkipWarning)  # DoubledLinear
        q = PtqQuantizer(model, [{"op_types": ["default"], "quant_types": ["weight"], "quant_bits": 8}])
    assert [(w.name, w._fn) for w in q.get_modules_wrapper()] == [("0", "linear"), ("2", "linear"),
                                                                  ("6", "linear")]
    q.calibrate([x])
    with torch.no_grad():
        out = model(x)
    assert float((out - ref).norm() / ref.norm()) < 0.02


def test_falcon_sparsegpt_2_4_checkpoint_reloads_with_the_in_memory_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    new_decoder_architecture=False, multi_query=True, parallel_attn=True,
                                    bias=False, alibi=False)
    model = transformers.FalconForCausalLM(cfg).eval()
    falcon_linear = type(model.transformer.h[0].mlp.dense_h_to_4h)
    assert falcon_linear.__name__ == "FalconLinear" and falcon_linear.forward is not nn.Linear.forward
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DefaultSkipWarning)  # the embedding
        p = SparseGPTPruner(model, [{"sparse_pattern": "2:4", "op_types": ["default"]},
                                    {"op_names": ["lm_head"], "exclude": True}])
    names = [w.name for w in p.get_modules_wrapper()]
    assert names == [f"transformer.h.{i}.{n}" for i in range(2) for n in
                     ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h",
                      "mlp.dense_4h_to_h")]
    p.calibrate(tokens, progress=False)
    for w in p.get_modules_wrapper():
        nz = (w.module.weight.detach().reshape(w.module.weight.shape[0], -1, 4) != 0).sum(-1)
        assert bool((nz == 2).all()), w.name
    with torch.no_grad():
        ref = model(tokens).logits
    p.export_model(None, hf_path=str(tmp_path / "ckpt"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt")).eval()
    assert type(loaded.transformer.h[0].mlp.dense_h_to_4h).__name__ == "FalconLinear"
    with torch.no_grad():
        out = loaded(tokens).logits
    assert float((out - ref).norm() / ref.norm()) < 1e-5
    w = loaded.transformer.h[1].mlp.dense_4h_to_h.weight
    assert int((w.reshape(w.shape[0], -1, 4) != 0).sum(-1).max()) == 2


def test_falcon_gptq_checkpoint_says_at_export_that_transformers_cannot_reload_it(tmp_path):
    """transformers' Falcon initialises FalconLinear.weight when it builds the model, and the packed checkpoint has
    no such weight: the export says so (a probe of the model's _init_weights), naming the layers; a Llama export,
    whose layers are plain Linear, says nothing of the kind."""
    transformers = pytest.importorskip("transformers")
    from compressor.torch import GptqQuantizer

    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    new_decoder_architecture=False, multi_query=True, parallel_attn=True,
                                    bias=False, alibi=False)
    model = transformers.FalconForCausalLM(cfg).eval()
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    q = GptqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["Linear"]},
                              {"op_names": ["lm_head"], "exclude": True}])
    q.calibrate(tokens, progress=False)
    with pytest.warns(UserWarning, match=r"transformers cannot reload this checkpoint: FalconForCausalLM._init_weights "
                                         r"reads FalconLinear.weight.*'transformer.h.0.self_attention.query_key_value'"):
        q.export_model(None, hf_path=str(tmp_path / "falcon"))
    with pytest.raises(AttributeError):  # what the warning foretells
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "falcon"))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)).eval()
    q = GptqQuantizer(llama, [{"quant_bits": 4, "group_size": 16, "op_types": ["Linear"]},
                              {"op_names": ["lm_head"], "exclude": True}])
    q.calibrate(tokens, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q.export_model(None, hf_path=str(tmp_path / "llama"))
    assert not [w for w in caught if "cannot reload" in str(w.message)]
