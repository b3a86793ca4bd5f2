"""One-shot compressors on keras-hub models built from tiny configs (issue 25): Llama3, GPT-2 and Gemma
backbones and a Llama3 causal LM (no tokenizer / preprocessor: keras-hub's tokenizers need tensorflow-text).
Blocks are found without naming the family, every Dense / EinsumDense of every decoder block is compressed,
and the calibration batches are keras-hub's ``{'token_ids', 'padding_mask'}`` dicts."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")

from compressor.core.errors import ConfigError  # noqa: E402
from compressor.tf import AwqQuantizer, GptqQuantizer, SparseGPTPruner, oneshot_codes  # noqa: E402
from compressor.tf.sequential import kernel_layout  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

VOCAB, LAYERS = 64, 2
IDS = np.random.default_rng(0).integers(1, VOCAB, (4, 8)).astype("int32")
PADDING = np.ones_like(IDS)
PADDING[2:, 6:] = 0  # two padded sequences
DATA = {"token_ids": IDS, "padding_mask": PADDING}


def llama3():
    return keras_hub.models.Llama3Backbone(vocabulary_size=VOCAB, num_layers=LAYERS, num_query_heads=4,
                                           num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)


def gpt2():
    return keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=LAYERS, num_heads=2, hidden_dim=16,
                                         intermediate_dim=32, max_sequence_length=16)


def gemma():
    return keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=LAYERS, num_query_heads=2,
                                          num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8)


def llama3_causal_lm():
    return keras_hub.models.Llama3CausalLM(backbone=llama3(), preprocessor=None)


#: model -> (builder, block path prefix, Dense + EinsumDense layers per decoder block)
MODELS = {
    "llama3": (llama3, "transformer_layer_", 7),  # q, k, v, o (EinsumDense) + gate, up, down (Dense)
    "gpt2": (gpt2, "transformer_layer_", 6),  # q, k, v, o + intermediate, output
    "gemma": (gemma, "decoder_block_", 7),  # q, k, v, o + two gating halves, linear
    "llama3_causal_lm": (llama3_causal_lm, "{backbone}/transformer_layer_", 7),  # inside the backbone
}


def build(name):
    keras.utils.set_random_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[name][0]()


def dense_layers_of(block):
    return [lyr for lyr in block._flatten_layers(include_self=False)
            if isinstance(lyr, (keras.layers.Dense, keras.layers.EinsumDense))]


@pytest.mark.parametrize("name", list(MODELS))
def test_sparsegpt_and_gptq_compress_every_projection_of_every_decoder_block(name):
    _, prefix, per_block = MODELS[name]
    model = build(name)
    prefix = prefix.format(backbone=getattr(model, "backbone", model).name)
    ref = model(DATA)
    p = SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    assert p.blocks == [f"{prefix}{i}" for i in range(LAYERS)], p.blocks
    blocks = [b for b in model._flatten_layers() if type(b).__name__ == type(p._blocks[0][1]).__name__]
    want = sorted(id(lyr) for b in blocks for lyr in dense_layers_of(b))
    assert len(want) == LAYERS * per_block
    assert sorted(id(w.layer) for w in p.modules_wrapper) == want  # exactly the blocks' Dense / EinsumDense
    p.calibrate(DATA, progress=False)
    assert len(p.rows) == LAYERS * per_block and {r["block"] for r in p.rows} == set(p.blocks)
    for w in p.modules_wrapper:
        plan = kernel_layout(w.name, w.layer)
        kernel = plan.to_canonical(w.weight.numpy())
        assert np.count_nonzero(kernel == 0) == kernel.size // 2, w.name  # exactly 50 % of every layer
        assert np.array_equal(kernel != 0, plan.to_canonical(w.weight_mask.numpy()))
    out = model(DATA)
    assert all(np.isfinite(np.asarray(v)).all() for v in keras.tree.flatten(out))
    assert not np.allclose(np.asarray(keras.tree.flatten(out)[0]), np.asarray(keras.tree.flatten(ref)[0]))

    model = build(name)
    q = GptqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}]).calibrate(DATA, progress=False)
    assert len(q.rows) == LAYERS * per_block
    assert [b.split("/")[-1] for b in q.blocks] == [b.split("/")[-1] for b in p.blocks]
    for w in q.modules_wrapper:
        plan = kernel_layout(w.name, w.layer)
        codes = oneshot_codes(w).astype(np.int64)
        assert codes.min() >= -7 and codes.max() <= 7 and codes.shape == (plan.n_out, plan.n_in)
        gs = min(16, plan.n_in)
        deq = codes * np.repeat(w.weight_group_scale.numpy(), gs, axis=1)
        np.testing.assert_allclose(plan.to_canonical(w.weight.numpy()), deq, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["gpt2"])
def test_a_config_that_matches_nothing_names_what_the_model_contains(name):
    model = build(name)
    for cfg in ({"op_types": ["Conv2D"]}, {"op_names": ["no_such_layer"]}):
        with pytest.raises(ConfigError) as e:
            SparseGPTPruner(model, [{"sparsity": 0.5, **cfg}])
        assert "selects no layer" in str(e.value)
        for kind in ("Dense", "EinsumDense", "TransformerDecoder", "ReversibleEmbedding"):
            assert f"'{kind}'" in str(e.value)


def test_awq_groups_the_projections_that_read_one_input():
    model = build("gemma")
    a = AwqQuantizer(model, [{"quant_bits": 4, "group_size": 8, "op_types": ["default"]}]).calibrate(DATA, progress=False)
    groups = {r["layer"].split("/", 1)[1]: r.get("group", "").split("/", 1)[-1] for r in a.rows if r["block"] == a.blocks[0]}
    assert groups == {"attention/query": "attention/query", "attention/key": "attention/query",
                      "attention/value": "attention/query", "attention/attention_output": "",
                      "ffw_gating": "ffw_gating", "ffw_gating_2": "ffw_gating", "ffw_linear": ""}
    out = model(DATA)
    assert np.isfinite(np.asarray(out)).all()
