"""Mixture-of-experts models in the one-shot methods (Keras): the decoder layers are the blocks (not the expert
layers, which are not a chain), each routed expert is calibrated on exactly the tokens its router sends to it,
an expert the data never reaches falls back with one warning, routers and fused expert banks are found (keras-hub's
banks are compressed per expert slice: tests/tf/test_moe_banks.py)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from compressor.core import oneshot as os1  # noqa: E402
from compressor.core.oneshot import experts as core_experts  # noqa: E402
from compressor.core.oneshot.observe import observers  # noqa: E402
from compressor.tf import AwqQuantizer, GptqQuantizer, SparseGPTPruner, WandaPruner, oneshot_codes  # noqa: E402
from compressor.tf.sequential import KerasOneShotBackend  # noqa: E402
from compressor.tf.sequential.blocks import find_experts, find_routers  # noqa: E402

pytestmark = [pytest.mark.tf]

D, FF, VOCAB, EXPERTS, LAYERS = 16, 24, 128, 8, 3


class Expert(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate_proj = keras.layers.Dense(FF, use_bias=False, name="gate_proj")
        self.up_proj = keras.layers.Dense(FF, use_bias=False, name="up_proj")
        self.down_proj = keras.layers.Dense(D, use_bias=False, name="down_proj")

    def call(self, x):
        return self.down_proj(keras.ops.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(keras.layers.Layer):
    """Top-2 routing over a list of expert layers, each called on the rows routed to it (none: an empty call)."""

    def __init__(self, n=EXPERTS, k=2, **kw):
        super().__init__(**kw)
        self.k = k
        self.router = keras.layers.Dense(n, name="router")
        self.experts = [Expert(name=f"expert{e}") for e in range(n)]

    def route(self, flat):
        w, idx = tf.math.top_k(tf.nn.softmax(self.router(flat), axis=-1), self.k)
        return w / tf.reduce_sum(w, -1, keepdims=True), idx

    def call(self, h):
        flat = tf.reshape(h, [-1, D])
        w, idx = self.route(flat)
        out = tf.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            hit = tf.where(tf.equal(idx, e))  # (row, slot) pairs
            y = expert(tf.gather(flat, hit[:, 0])) * tf.gather_nd(w, hit)[:, None]
            out = tf.tensor_scatter_nd_add(out, hit[:, :1], y)
        return tf.reshape(out, tf.shape(h))


class Layer(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.norm1 = keras.layers.LayerNormalization(name="norm1")
        self.norm2 = keras.layers.LayerNormalization(name="norm2")
        self.attn = keras.layers.Dense(D, name="attn")  # stands for the attention
        self.moe = MoE(name="moe")

    def pre_moe(self, h):
        h = h + self.attn(self.norm1(h))
        return h, self.norm2(h)

    def call(self, h):
        h, x = self.pre_moe(h)
        return h + self.moe(x)


class Net(keras.Model):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.embed = keras.layers.Embedding(VOCAB, D, name="embed")
        self.decoder = [Layer(name=f"layer{i}") for i in range(LAYERS)]
        self.head = keras.layers.Dense(VOCAB, use_bias=False, name="head")

    def call(self, ids):
        h = self.embed(ids)
        for layer in self.decoder:
            h = layer(h)
        return self.head(h)


CALIB = np.random.default_rng(1).integers(0, VOCAB, (16, 16)).astype("int32")


def build(seed=0, dead=()):
    """The MoE decoder, built; the experts in ``dead`` never win the routing (router bias -1e4)."""
    keras.utils.set_random_seed(seed)
    model = Net()
    model(CALIB[:1])
    for layer in model.decoder:
        b = layer.moe.router.bias.numpy()
        b[list(dead)] = -1e4
        layer.moe.router.bias.assign(b)
    return model


def make(cls, model, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Embedding left out
        return cls(model, [{**cfg, "op_types": ["default"]}])


def calibrate(comp, **kw):
    """``comp.calibrate`` on CALIB and the warnings it gave (every one recorded)."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        comp.calibrate(CALIB, progress=False, **kw)
    return [str(w.message) for w in got]


def expert_layers(model):
    return [(f"layer{i}/moe/expert{e}/{n}", getattr(ex, n)) for i, ly in enumerate(model.decoder)
            for e, ex in enumerate(ly.moe.experts) for n in ("gate_proj", "up_proj", "down_proj")]


def routed_rows(model, batches):
    """Per expert of layer 0: the MoE input rows the router sends to it, one float32 array per batch."""
    out = {e: [] for e in range(EXPERTS)}
    for ids in batches:
        _, x = model.decoder[0].pre_moe(model.embed(ids))
        flat = tf.reshape(x, [-1, D])
        _, idx = model.decoder[0].moe.route(flat)
        for e in range(EXPERTS):
            rows = tf.where(tf.reduce_any(tf.equal(idx, e), axis=-1))[:, 0]
            out[e].append(tf.gather(flat, rows).numpy())
    return out


def test_the_blocks_are_the_decoder_layers_and_the_experts_are_found():
    model = build()
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    assert [n for n, _ in p._blocks] == ["layer0", "layer1", "layer2"]
    sets = find_experts(model)
    assert [(s.parent, s.members, s.count, s.fused, s.routers, s.gates) for s in sets] == [
        (f"layer{i}/moe", [f"layer{i}/moe/expert{e}" for e in range(EXPERTS)], EXPERTS, False,
         [f"layer{i}/moe/router"], []) for i in range(LAYERS)]
    assert find_routers(model) == [f"layer{i}/moe/router" for i in range(LAYERS)]
    be = KerasOneShotBackend(p, p._blocks)
    marked = {t.name: core_experts.routed_expert(t) for t in be.tasks.values()}
    assert marked["layer2/moe/expert3/up_proj"] == "layer2/moe/expert3"
    assert marked["layer2/attn"] is None and "layer2/moe/router" not in marked  # routers: float by default
    assert sum(v is not None for v in marked.values()) == LAYERS * EXPERTS * 3
    # a chain of blocks: calibrated block by block, no warning, every expert half pruned
    assert calibrate(p, num_samples=8) == []
    for name, layer in expert_layers(model):
        k = layer.kernel.numpy()
        assert np.count_nonzero(k == 0) == k.size // 2, name


def test_each_experts_gram_is_that_of_the_tokens_routed_to_it():
    model = build()
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    batches = [CALIB[i:i + 8] for i in (0, 8)]
    ref = routed_rows(model, batches)
    be = KerasOneShotBackend(p, p._blocks)
    name, block = be.blocks()[0]
    inputs = be.first_inputs(batches)
    tasks = be.block_layers(block)
    accs, observe = observers(p.method, tasks, be.shared_inputs(block, inputs, tasks))
    be.run_block(block, inputs, observe)
    total = 0
    for e in range(EXPERTS):
        acc = accs[f"{name}/moe/expert{e}/up_proj"]
        expect = os1.GramAccumulator(D)
        for rows in ref[e]:
            expect.add(rows)
        assert acc.count == expect.count == sum(len(r) for r in ref[e]) > 0
        np.testing.assert_array_equal(acc.gram, expect.gram)
        assert accs[f"{name}/moe/expert{e}/down_proj"].count == acc.count
        total += acc.count
    assert total == 2 * CALIB.size


@pytest.mark.parametrize("cls,cfg,fallback", [
    (WandaPruner, {"sparsity": 0.5}, "magnitude"),
    (GptqQuantizer, {"quant_bits": 4, "group_size": 8}, "rtn"),
])
def test_an_expert_without_tokens_falls_back_with_one_warning(cls, cfg, fallback):
    model = build(dead=(7,))
    before = {n: layer.kernel.numpy().T.astype(np.float64) for n, layer in expert_layers(model)}
    c = make(cls, model, cfg)
    got = calibrate(c, num_samples=8)
    dead = [f"layer{i}/moe/expert7" for i in range(LAYERS)]
    how = "magnitude pruning" if fallback == "magnitude" else "round to nearest"
    assert got == [f"{c.method.name}: 3 routed expert(s) saw no calibration token and were compressed without "
                   f"statistics ({how}, 9 layer(s)): " + ", ".join(f"{d} (0 tokens)" for d in dead)
                   + "; more (or more varied) calibration data reaches them"]
    rows = {r["layer"]: r for r in c.rows}
    for name, layer in expert_layers(model):
        expert = name.rsplit("/", 1)[0]
        assert ("fallback" in rows[name]) == (expert in dead)
        if expert not in dead:
            continue
        assert (rows[name]["fallback"], rows[name]["tokens"]) == (fallback, 0)
        w = layer.kernel.numpy().T
        if fallback == "magnitude":
            keep = os1.wanda_mask(before[name], np.ones(w.shape[1]), 0.5)
            np.testing.assert_array_equal(w != 0, keep)
        else:
            q = os1.rtn_quantize(before[name], c._specs[name])
            wrapper = next(wr for wr in c.modules_wrapper if wr.name == name)
            np.testing.assert_array_equal(oneshot_codes(wrapper), q.codes)
            np.testing.assert_array_equal(w, q.dequantized.astype(np.float32))


@pytest.mark.parametrize("search", ["block", "layer"])
def test_awq_on_an_expert_called_without_tokens_falls_back_to_round_to_nearest(search):
    """This model calls an expert without tokens with an empty batch: its gate / up share one (empty) input. AWQ's
    block search leaves such an expert out of its groups and, as the layer search, gives its layers round to
    nearest, with one warning naming the experts; every other expert is searched as usual."""
    c = make(AwqQuantizer, build(dead=(7,)), {"quant_bits": 4, "group_size": 8, "awq_search": search})
    got = calibrate(c, num_samples=4)
    assert len(got) == 1 and got[0].startswith("awq: 3 routed expert(s) saw no calibration token")
    assert {r["layer"] for r in c.rows if r.get("fallback") == "rtn"} == {
        f"layer{i}/moe/expert7/{n}" for i in range(LAYERS) for n in ("gate_proj", "up_proj", "down_proj")}
    assert all("alpha" in r for r in c.rows if r.get("fallback") is None)  # the others were searched


def test_routers_stay_float_by_default_and_are_compressed_when_named():
    model = build()
    before = [ly.moe.router.kernel.numpy().copy() for ly in model.decoder]
    p = make(SparseGPTPruner, model, {"sparsity": 0.5})
    assert not any(w.name.endswith("/router") for w in p.modules_wrapper)
    assert calibrate(p, num_samples=4) == []
    assert all(np.array_equal(b, ly.moe.router.kernel.numpy()) for b, ly in zip(before, model.decoder))
    named = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = SparseGPTPruner(named, [{"sparsity": 0.5, "op_types": ["default"]},
                                    {"sparsity": 0.5, "op_names": ["layer1/moe/router"]}])
    assert calibrate(q, num_samples=4) == []
    assert np.count_nonzero(named.decoder[1].moe.router.kernel.numpy() == 0) == D * EXPERTS // 2
    assert np.array_equal(before[0], named.decoder[0].moe.router.kernel.numpy())


def test_keras_hub_mixtrals_expert_bank_is_found_compressed_and_named_only_when_it_stays_uncompressed(monkeypatch):
    """keras-hub's Mixtral bank is compressed slice by slice (tests/tf/test_moe_banks.py): no warning. A bank whose
    per-expert computation is unknown (here: Mixtral's class taken out of expert_banks.BANKS) stays as it is, named
    in one warning."""
    keras_hub = pytest.importorskip("keras_hub")
    from compressor.tf.sequential import expert_banks

    keras.backend.clear_session()  # the layer names below are the first of their kind (no _N suffix)
    keras.utils.set_random_seed(0)
    bb = keras_hub.models.MixtralBackbone(vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2,
                                          hidden_dim=32, intermediate_dim=48, num_experts=4, top_k=2)
    moe = ["transformer_layer_0/mixtral_sparse_moe_block", "transformer_layer_1/mixtral_sparse_moe_block_1"]
    sets = find_experts(bb)
    assert [(s.parent, s.members, s.count, s.fused, s.routers) for s in sets] == [
        (m, [f"{m}/experts"], 4, True, [f"{m}/sparse_feedforward_gate_dense"]) for m in moe]
    assert find_routers(bb) == [f"{m}/sparse_feedforward_gate_dense" for m in moe]

    def fused_warnings():
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            q = GptqQuantizer(bb, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
        assert [n for n, _ in q._blocks] == ["transformer_layer_0", "transformer_layer_1"]
        q.strip()
        return [str(w.message) for w in got if "fused" in str(w.message)]

    assert fused_warnings() == []
    monkeypatch.delitem(expert_banks.BANKS, "MixtralMoeExperts")
    assert fused_warnings() == [
        "one-shot calibration: the routed experts of 2 mixture-of-experts layer(s) are fused 3-D weights "
        "(transformer_layer_0/mixtral_sparse_moe_block/experts: expert_feedforward_gate_dense [4, 32, 48], "
        "expert_feedforward_intermediate_dense [4, 32, 48], expert_feedforward_output_dense [4, 48, 32] and 1 more "
        "like it) and are NOT compressed: the one-shot methods compress Dense / EinsumDense layers and the expert "
        "banks of compressor.tf.sequential.expert_banks.BANKS"]
