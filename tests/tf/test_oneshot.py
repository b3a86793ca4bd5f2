"""One-shot compressors on Keras 3 (issue 25): WandaPruner, SparseGPTPruner, GptqQuantizer, RtnQuantizer,
AwqQuantizer on a tiny causal LM of our own (Embedding -> 2 x DecoderBlock(LayerNorm, MultiHeadAttention with a
causal mask, gelu FFN) -> Dense head; vocab 64, width 32), and the calibration data forms."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from compressor.core import oneshot as os1  # noqa: E402
from compressor.core.errors import ConfigError, ModelError  # noqa: E402
from compressor.tf import (  # noqa: E402
    AwqQuantizer,
    GptqQuantizer,
    LevelPruner,
    PtqQuantizer,
    RtnQuantizer,
    SparseGPTPruner,
    WandaPruner,
    oneshot_codes,
)
from compressor.tf.calibration_data import calibration_batches  # noqa: E402
from compressor.tf.kernel_layout import _einsum_layout, kernel_layout  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.filterwarnings("ignore:.*leaves out weighted layers")]

VOCAB, WIDTH = 64, 32
DEFAULT = {"op_types": ["default"]}


class DecoderBlock(keras.layers.Layer):
    def __init__(self, width, heads, ffn, **kw):
        super().__init__(**kw)
        self.ln1 = keras.layers.LayerNormalization(name="ln1")
        self.attn = keras.layers.MultiHeadAttention(heads, width // heads, name="attn")
        self.ln2 = keras.layers.LayerNormalization(name="ln2")
        self.up = keras.layers.Dense(ffn, activation="gelu", name="up")
        self.down = keras.layers.Dense(width, name="down")

    def call(self, x, training=False):
        h = self.ln1(x)
        x = x + self.attn(h, h, use_causal_mask=True, training=training)
        return x + self.down(self.up(self.ln2(x)))


class TinyLM(keras.Model):
    def __init__(self, n=2, **kw):
        super().__init__(**kw)
        self.embed = keras.layers.Embedding(VOCAB, WIDTH, name="embed")
        self.decoder = [DecoderBlock(WIDTH, 4, 2 * WIDTH, name=f"block{i}") for i in range(n)]
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.head = keras.layers.Dense(VOCAB, name="head")

    def call(self, ids, training=False):
        x = self.embed(ids)
        for b in self.decoder:
            x = b(x, training=training)
        return self.head(self.norm(x))


RNG = np.random.default_rng(0)
CALIB = RNG.integers(0, VOCAB, (16, 12)).astype("int32")
HELD = RNG.integers(0, VOCAB, (8, 12)).astype("int32")
LAYERS = [f"block{i}/{n}" for i in range(2)
          for n in ("attn/query", "attn/key", "attn/value", "attn/attention_output", "up", "down")]


def lm(seed=0):
    keras.utils.set_random_seed(seed)
    m = TinyLM()
    m(CALIB[:1])
    return m


def err(model, ref):
    return float(np.mean((model(HELD).numpy() - ref) ** 2))


def canon(p, name):
    w = next(w for w in p.modules_wrapper if w.name == name)
    return kernel_layout(name, w.layer).to_canonical(w.weight.numpy()), w


def test_blocks_are_found_and_the_lm_head_is_left_out():
    m = lm()
    p = SparseGPTPruner(m, [{"sparsity": 0.5, **DEFAULT}])
    assert p.blocks == ["block0", "block1"]
    assert p.excluded == ["head"]
    assert [w.name for w in p.modules_wrapper] == LAYERS
    assert [w.type for w in p.modules_wrapper][:6] == ["EinsumDense"] * 4 + ["Dense"] * 2
    q = SparseGPTPruner(lm(), [{"sparsity": 0.5, **DEFAULT}, {"op_names": ["head"], "sparsity": 0.5}])
    assert q.excluded == [] and q.modules_wrapper[-1].name == "head"  # named: compressed after the blocks


def test_sparsegpt_exact_sparsity_and_closer_to_dense_than_magnitude_and_wanda_2_4():
    m = lm()
    ref = m(HELD).numpy()
    dense = m.get_weights()
    p = SparseGPTPruner(m, [{"sparsity": 0.5, **DEFAULT}]).calibrate(CALIB, progress=False)
    for name in LAYERS:
        w, wrapper = canon(p, name)
        keep = kernel_layout(name, wrapper.layer).to_canonical(wrapper.weight_mask.numpy())
        assert keep.sum() == keep.size // 2  # exactly 50 % of each layer
        assert np.all(w[~keep] == 0)
    e_sgpt = err(m, ref)
    assert np.isfinite(e_sgpt)
    p.strip()
    m.set_weights(dense)
    LevelPruner(m, [{"sparsity": 0.5, "op_names": LAYERS}]).compress()
    e_mag = err(m, ref)
    assert e_sgpt < e_mag
    m2 = lm()
    w = WandaPruner(m2, [{"sparse_pattern": "2:4", **DEFAULT}]).calibrate(CALIB, progress=False)
    for name in LAYERS:
        wrapper = next(x for x in w.modules_wrapper if x.name == name)
        keep = kernel_layout(name, wrapper.layer).to_canonical(wrapper.weight_mask.numpy())
        assert (keep.reshape(keep.shape[0], -1, 4).sum(-1) == 2).all()
    assert np.isfinite(m2(HELD).numpy()).all()


@contextlib.contextmanager
def _grabbing(layer):
    """The inputs of ``layer``'s calls while the body runs (a test-side wrapped ``call``), as arrays."""
    seen = []
    orig = layer.call

    def grab(x, *a, **k):
        seen.append(np.asarray(x))
        return orig(x, *a, **k)

    object.__setattr__(layer, "call", grab)
    try:
        yield seen
    finally:
        object.__delattr__(layer, "call")


def _inputs_of(model, layer, batches, block0_weights=None):
    """Float32 inputs of ``layer`` (captured by a test-side wrapped call) on each batch."""
    with _grabbing(layer) as seen:
        for b in batches:
            model(b)
    return seen


def test_block_2_statistics_come_from_the_compressed_block_1():
    m = lm()
    dense = m.get_weights()
    w_up = m.decoder[1].up.kernel.numpy()
    p = SparseGPTPruner(m, [{"sparsity": 0.5, **DEFAULT}]).calibrate(CALIB, progress=False, forward_dtype="model")
    got = m.decoder[1].up.kernel.numpy()
    pruned0 = [v.numpy() for v in m.decoder[0].weights]
    p.strip()
    batches = [CALIB[:8], CALIB[8:]]

    ref = lm()

    def expected(block0):
        ref.set_weights(dense)
        for v, val in zip(ref.decoder[0].weights, block0):
            v.assign(val)
        acc = os1.GramAccumulator(WIDTH)
        for x in _inputs_of(ref, ref.decoder[1].up, batches):
            acc.add(x.astype(np.float64).reshape(-1, WIDTH))
        return os1.sparsegpt_prune(w_up.T.astype(np.float64), acc.gram, 0.5).weight.T.astype(np.float32)

    np.testing.assert_array_equal(got, expected(pruned0))  # block 1 calibrated on the COMPRESSED block 0
    ref.set_weights(dense)
    dense0 = [v.numpy() for v in ref.decoder[0].weights]
    assert not np.array_equal(got, expected(dense0))


def test_forward_dtype_float64_statistics_are_those_of_a_float64_forward():
    """'float64' (and 'auto' on CPU): block 1's statistics are those of a float64 model (built under a float64 dtype
    policy, the compressed weights loaded) whose block 0 output is rounded to float32, as the engine keeps the
    activations in the model's dtype between blocks; the model's variables and policies stay float32."""
    m = lm()
    dense = m.get_weights()
    w_up = m.decoder[1].up.kernel.numpy()
    SparseGPTPruner(m, [{"sparsity": 0.5, **DEFAULT}]).calibrate(CALIB, progress=False, forward_dtype="float64")
    got = m.decoder[1].up.kernel.numpy()
    assert all(v.dtype == "float32" for v in m.weights)
    assert all(lay.dtype_policy.name == "float32" for lay in m._flatten_layers(include_self=True, recursive=True))
    pruned0 = [v.numpy() for v in m.decoder[0].weights]
    keras.config.set_dtype_policy("float64")
    try:
        ref = TinyLM()
        ref(CALIB[:1])
    finally:
        keras.config.set_dtype_policy("float32")
    ref.set_weights([w.astype(np.float64) for w in dense])
    for v, val in zip(ref.decoder[0].weights, pruned0):
        v.assign(val.astype(np.float64))
    with _grabbing(ref.decoder[1].up) as seen:
        for b in (CALIB[:8], CALIB[8:]):
            h = ref.decoder[0](ref.embed(b))
            ref.decoder[1](tf.cast(tf.cast(h, "float32"), "float64"))
    assert all(x.dtype == np.float64 for x in seen)
    acc = os1.GramAccumulator(WIDTH)
    for x in seen:
        acc.add(x.reshape(-1, WIDTH))
    np.testing.assert_array_equal(got, os1.sparsegpt_prune(w_up.T.astype(np.float64), acc.gram, 0.5).weight.T.astype(np.float32))


def test_forward_dtype_float64_runs_the_block_on_slices_of_the_batch(monkeypatch):
    """A float64 block call covers at most FLOAT64_PASS_TOKENS tokens (TensorFlow's allocator keeps its peak):
    with 24 tokens a slice, each 8-sequence batch of 12 tokens runs as 4 calls of 2 sequences; the layers see
    the same rows as one call on the whole batch, and the pruned kernels match the unsliced run's."""
    import compressor.tf.sequential.backend as tfo

    whole = lm()
    SparseGPTPruner(whole, [{"sparsity": 0.5, **DEFAULT}]).calibrate(CALIB, progress=False, forward_dtype="float64")
    m = lm()
    monkeypatch.setattr(tfo, "FLOAT64_PASS_TOKENS", 24)
    with _grabbing(m.decoder[1].up) as seen:
        SparseGPTPruner(m, [{"sparsity": 0.5, **DEFAULT}]).calibrate(CALIB, progress=False, forward_dtype="float64")
    observed = [x for x in seen if x.dtype == np.float64]
    assert [x.shape[0] for x in observed] == [2] * 8  # 16 sequences, 2 per float64 call
    for a, b in zip(whole.weights, m.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)


def test_awq_search_passes_run_on_slices_of_the_batch(monkeypatch):
    """AWQ's search runs its module on at most SEARCH_PASS_TOKENS tokens a call (TensorFlow's allocator keeps the
    largest call's transients): with 24 tokens, 2 sequences of 12 a call; the scales and codes are the unsliced
    run's."""
    import compressor.tf.sequential.backend as tfo

    cfg = [{"quant_bits": 4, "group_size": 8, "search_samples": None, **DEFAULT}]
    whole = AwqQuantizer(lm(), cfg).calibrate(CALIB, progress=False)
    sizes = []
    real = tfo.KerasOneShotBackend._sliced

    def spy(self, fn, inp):
        out = real(self, fn, inp)
        sizes.append((self.batch_rows(inp), out.shape[0]))
        return out

    monkeypatch.setattr(tfo, "SEARCH_PASS_TOKENS", 24)
    monkeypatch.setattr(tfo.KerasOneShotBackend, "_sliced", spy)
    m = lm()
    sliced = AwqQuantizer(m, cfg).calibrate(CALIB, progress=False)
    assert sizes and all(a == b == 8 for a, b in sizes)  # whole 8-sequence outputs, computed 2 sequences a call
    for w, v in zip(whole.modules_wrapper, sliced.modules_wrapper):
        np.testing.assert_allclose(w.awq_scales.numpy(), v.awq_scales.numpy(), rtol=1e-6)
        np.testing.assert_array_equal(w.weight_codes.numpy(), v.weight_codes.numpy())


def test_forward_dtype_bad_value_is_a_config_error_before_the_model_changes():
    m = lm()
    before = m.get_weights()
    p = SparseGPTPruner(m, [{"sparsity": 0.5, **DEFAULT}])
    for bad in ("fp64", None, "float16"):
        with pytest.raises(ConfigError, match=r"forward_dtype must be one of \['auto', 'float64', 'model'\]"):
            p.calibrate(CALIB, progress=False, forward_dtype=bad)
    p.strip()
    assert all(np.array_equal(a, b) for a, b in zip(before, m.get_weights())) and not p.calibrated


def test_gptq_closer_than_rtn_codes_in_range_and_kernel_is_the_dequantized_grid():
    m = lm()
    ref = m(HELD).numpy()
    dense = m.get_weights()
    cfg = [{"quant_bits": 4, "group_size": 8, **DEFAULT}]
    g = GptqQuantizer(m, cfg).calibrate(CALIB, progress=False)
    e_gptq = err(m, ref)
    for name in LAYERS:
        w, wrapper = canon(g, name)
        codes = oneshot_codes(wrapper).astype(np.int64)
        assert codes.min() >= -7 and codes.max() <= 7 and wrapper.weight_codes.dtype == tf.int8
        scale = wrapper.weight_group_scale.numpy()
        assert scale.shape == (w.shape[0], w.shape[1] // 8)
        deq = codes * np.repeat(scale, 8, axis=1)
        np.testing.assert_array_equal(w, deq.astype(np.float32))
    assert {r["bits"] for r in g.report()} == {4}
    g.strip()
    m.set_weights(dense)
    r = RtnQuantizer(m, cfg).calibrate(progress=False)  # RTN needs no data
    e_rtn = err(m, ref)
    assert np.isfinite(e_gptq) and e_gptq < e_rtn
    r.strip()
    m.set_weights(dense)
    a = AwqQuantizer(m, [{"quant_bits": 4, "group_size": 8, "quant_scheme": "affine", **DEFAULT}])
    a.calibrate(CALIB, progress=False)
    wrapper = a.modules_wrapper[0]
    assert wrapper.weight_codes.dtype == tf.uint8 and int(oneshot_codes(wrapper).max()) <= 15
    assert wrapper.awq_scales.shape == (WIDTH,) and np.isfinite(m(HELD).numpy()).all()


def test_sparsegpt_2_4_then_gptq_w4_keeps_the_zeros():
    m = lm()
    p = SparseGPTPruner(m, [{"sparse_pattern": "2:4", **DEFAULT}]).calibrate(CALIB, progress=False)
    zeros = {n: canon(p, n)[0] == 0 for n in LAYERS}
    q = GptqQuantizer(m, [{"quant_bits": 4, **DEFAULT}]).calibrate(CALIB, progress=False)
    for n in LAYERS:
        w, wrapper = canon(q, n)
        assert np.all(w[zeros[n]] == 0) and np.all(oneshot_codes(wrapper)[zeros[n]] == 0)
        assert (w.reshape(w.shape[0], -1, 4) != 0).sum(-1).max() <= 2


class Inner(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.proj = keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, 3, 5), name="proj")
        self.out = keras.layers.EinsumDense("abcd,cde->abe", output_shape=(None, 8), name="out")

    def call(self, x):
        return self.out(self.proj(x))


class Outer(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.inner = Inner(name="inner")

    def call(self, x):
        return self.inner(x)


def test_einsum_dense_nested_in_subclassed_layers_layout_and_gptq():
    keras.utils.set_random_seed(1)
    m = keras.Sequential([keras.Input((6, 8)), Outer(name="outer")])
    x = np.random.default_rng(1).normal(size=(10, 6, 8)).astype("float32")
    proj = m.layers[0].inner.proj
    plan = kernel_layout("p", proj)
    assert (plan.n_out, plan.n_in) == (15, 8)
    wc = plan.to_canonical(proj.kernel.numpy())
    np.testing.assert_allclose(proj(x).numpy().reshape(-1, 15), x.reshape(-1, 8) @ wc.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(plan.from_canonical(wc), proj.kernel.numpy())
    out_plan = kernel_layout("o", m.layers[0].inner.out)
    assert (out_plan.n_out, out_plan.n_in) == (8, 15)
    assert _einsum_layout("k", "abc,dce->abde", (2, 8, 5)).perm == (0, 2, 1)  # [out d, out e, in c]
    with pytest.raises(ConfigError, match="EinsumDense.*equation 'abc,bd->acd'.*trailing axes"):
        _einsum_layout("bad", "abc,bd->acd", (6, 5))  # contracts a middle axis of the input
    w_proj = wc.copy()
    g = GptqQuantizer(m, [{"quant_bits": 4, **DEFAULT}]).calibrate(x, progress=False)
    assert [w.name for w in g.modules_wrapper] == ["outer/inner/proj", "outer/inner/out"]
    assert g.blocks == []  # no repeated layers: one pass of the whole model
    acc = os1.GramAccumulator(8)
    for i in range(0, 10, 8):
        acc.add(x[i:i + 8].astype(np.float64).reshape(-1, 8))
    ref = os1.gptq_quantize(w_proj, acc.gram, os1.QuantSpec(4))
    np.testing.assert_array_equal(plan.to_canonical(proj.kernel.numpy()), ref.dequantized.astype(np.float32))


def test_calibration_data_forms():
    y = np.zeros((16,), "int32")
    ds = tf.data.Dataset.from_tensor_slices(CALIB).batch(8)
    forms = [CALIB, list(CALIB.reshape(2, 8, 12)), tf.constant(CALIB), (CALIB, y), ds,
             tf.data.Dataset.from_tensor_slices((CALIB, y)).batch(8),
             tf.data.Dataset.from_tensor_slices((CALIB, y, y)).batch(8), [(CALIB[:8], y[:8]), (CALIB[8:], y[8:])]]
    for data in forms:
        got = list(calibration_batches(data, what="t", batch_size=8))
        assert [b.shape[0] for b in got] == [8, 8]
        np.testing.assert_array_equal(np.concatenate([np.asarray(b) for b in got]), CALIB)
    cut = list(calibration_batches(ds, what="t", num_samples=11))  # the last batch is cut
    assert [b.shape[0] for b in cut] == [8, 3]
    # dicts (keras-hub style named inputs) are split into batches like arrays
    d = {"token_ids": CALIB, "padding_mask": np.ones_like(CALIB, bool)}
    got = list(calibration_batches(d, what="t", batch_size=8, num_samples=12))
    assert [sorted(b) for b in got] == [["padding_mask", "token_ids"]] * 2
    assert [b["token_ids"].shape[0] for b in got] == [8, 4]
    with pytest.raises(ConfigError, match="calibration batch 1 is empty"):
        list(calibration_batches([CALIB, CALIB[:0]], what="t"))
    with pytest.raises(ConfigError, match="must be a tensor / numpy array of samples.*got int"):
        calibration_batches(3, what="t")

    def masks(data, **kw):  # end to end: the same statistics whatever the form
        m = lm()
        p = WandaPruner(m, [{"sparsity": 0.5, **DEFAULT}]).calibrate(data, progress=False, **kw)
        return [w.weight_mask.numpy() for w in p.modules_wrapper]

    want = masks(CALIB)
    for a, b in zip(masks(tf.data.Dataset.from_tensor_slices((np.concatenate([CALIB, HELD]), np.zeros(24), np.ones(24)))
                          .batch(5), num_samples=16), want):
        np.testing.assert_array_equal(a, b)


def test_dict_input_functional_model():
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    mask = keras.Input((None,), dtype="bool", name="padding_mask")
    keras.utils.set_random_seed(2)
    x = keras.layers.Embedding(VOCAB, WIDTH)(ids)
    x = keras.layers.Dense(WIDTH, name="d1")(x)
    x = keras.layers.Dense(WIDTH, name="d2")(x)
    x = keras.ops.where(keras.ops.expand_dims(mask, -1), x, 0.0)
    m = keras.Model({"token_ids": ids, "padding_mask": mask}, keras.layers.Dense(VOCAB, name="lm")(x))
    data = {"token_ids": CALIB, "padding_mask": np.ones_like(CALIB, bool)}
    p = SparseGPTPruner(m, [{"sparsity": 0.25, **DEFAULT}]).calibrate(data, progress=False)
    assert [w.name for w in p.modules_wrapper] == ["d1", "d2"] and p.excluded == ["lm"]
    assert all(float(np.mean(w.weight_mask.numpy())) == 0.75 for w in p.modules_wrapper)


@pytest.mark.parametrize("user_setting", [None, False, True])
def test_calibrate_turns_the_remapper_off_while_it_runs_and_puts_the_users_setting_back(user_setting, monkeypatch):
    import tensorflow as tf

    from compressor.tf.sequential import mixin as tos

    opts = tf.config.optimizer.get_experimental_options()
    if user_setting is not None:
        tf.config.optimizer.set_experimental_options({"remapping": user_setting})
    seen = []
    real = tos.run_sequential

    def spy(*a, **k):
        seen.append(tf.config.optimizer.get_experimental_options().get("remapping"))
        return real(*a, **k)
    monkeypatch.setattr(tos, "run_sequential", spy)
    try:
        AwqQuantizer(lm(), [{"quant_bits": 4, "group_size": 8, **DEFAULT}]).calibrate(CALIB, progress=False)
        assert seen == [False]
        after = tf.config.optimizer.get_experimental_options().get("remapping")
        assert after == (True if user_setting is None else user_setting)
    finally:
        tf.config.optimizer.set_experimental_options({"remapping": opts.get("remapping", True)})


def test_errors_before_the_model_changes():
    m = lm()
    before = [v.numpy().copy() for v in m.weights]
    checks = [
        (ModelError, r"no layer of these classes; its layers with sub-layers are .*DecoderBlock",
         lambda: SparseGPTPruner(m, [{"sparsity": 0.5, **DEFAULT}], sequential_targets=["TransformerDecoder"])),
        (ConfigError, r"selects no layer.*Layer types in the model: \[.*'Dense'",
         lambda: SparseGPTPruner(m, [{"sparsity": 0.5, "op_types": ["Conv2D"]}])),
        (ConfigError, "only the LM head",
         lambda: RtnQuantizer(m, [{"quant_bits": 4, **DEFAULT}, {"op_names": LAYERS, "exclude": True}])),
        (ConfigError, "not a multiple of M=5", lambda: SparseGPTPruner(m, [{"sparse_pattern": "1:5", **DEFAULT}])),
        (ConfigError, "quant_bits 2..8", lambda: GptqQuantizer(m, [{"quant_bits": 1, **DEFAULT}])),
        (ConfigError, "quant_scheme", lambda: GptqQuantizer(m, [{"quant_bits": 4, "quant_scheme": "weird", **DEFAULT}])),
        (ConfigError, "damp", lambda: SparseGPTPruner(m, [{"sparsity": 0.5, "damp": 2.0, **DEFAULT}])),
        (ConfigError, "sequential_targets", lambda: WandaPruner(m, [{"sparsity": 0.5, **DEFAULT}], sequential_targets=[3])),
        (ConfigError, r"'apply_clip' = 1 is invalid.*True or False",
         lambda: AwqQuantizer(m, [{"quant_bits": 4, "apply_clip": 1, **DEFAULT}])),
    ]
    for exc, match, make in checks:
        with pytest.raises(exc, match=match):
            make()
    p = SparseGPTPruner(m, [{"sparsity": 0.5, **DEFAULT}])
    bad = CALIB.astype("float32")
    bad[11, 2] = np.nan
    with pytest.raises(ConfigError, match="calibration batch 1 contains NaN or inf"):
        p.calibrate(bad, progress=False)
    with pytest.raises(ConfigError, match="calibration data is empty"):
        p.calibrate([], progress=False)
    with pytest.raises(ConfigError, match="needs calibration data"):
        p.calibrate(progress=False)
    with pytest.raises(ModelError, match="refused calibration batch 0"):
        p.calibrate(np.zeros((4, 3, 2, 1), "float32"), progress=False)
    for v, b in zip(m.weights, before):
        np.testing.assert_array_equal(v.numpy(), b)
    assert all(bool(np.all(w.weight_mask.numpy())) for w in p.modules_wrapper)
    # every call wrapped for calibration is restored after the errors (only the pruner's own wrapper remains)
    assert all("call" not in vars(b) and "quantized_call" not in vars(b) for b in m.decoder)
    assert all(vars(w.layer)["call"] == w._call and "quantized_call" not in vars(w.layer) for w in p.modules_wrapper)


class Parallel(keras.Model):
    """Two blocks of one class applied to the SAME input: not a chain."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.embed = keras.layers.Embedding(VOCAB, WIDTH)
        self.a = DecoderBlock(WIDTH, 4, WIDTH, name="a")
        self.b = DecoderBlock(WIDTH, 4, WIDTH, name="b")

    def call(self, ids):
        x = self.embed(ids)
        return self.a(x) + self.b(x)


def test_repeated_layers_that_are_not_a_chain():
    keras.utils.set_random_seed(3)
    m = Parallel()
    m(CALIB[:1])
    p = WandaPruner(m, [{"sparsity": 0.5, **DEFAULT}])
    assert p.blocks == ["a", "b"]
    with pytest.warns(RuntimeWarning, match="not a chain of blocks.*whole model in one pass"):
        p.calibrate(CALIB, progress=False)
    assert all(float(np.mean(w.weight_mask.numpy())) == 0.5 for w in p.modules_wrapper)
    m2 = Parallel()
    m2(CALIB[:1])
    before = [v.numpy().copy() for v in m2.weights]
    with pytest.raises(ModelError, match="cannot be calibrated one after the other"):
        WandaPruner(m2, [{"sparsity": 0.5, **DEFAULT}], sequential_targets="DecoderBlock").calibrate(CALIB, progress=False)
    for v, b in zip(m2.weights, before):
        np.testing.assert_array_equal(v.numpy(), b)


def test_ptq_calibrate_takes_the_same_forms():
    keras.utils.set_random_seed(4)
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="d")])
    x = np.random.default_rng(4).normal(size=(20, 8)).astype("float32")
    cfg = [{"quant_types": ["weight", "input"], "quant_bits": 8, "op_types": ["Dense"]}]
    a = PtqQuantizer(m, cfg).calibrate(x).get_modules_wrapper()[0].input_scale.numpy()
    m2 = keras.models.clone_model(m)
    m2.set_weights(m.get_weights())
    ds = tf.data.Dataset.from_tensor_slices((x, x[:, :1], x[:, 0])).batch(7)  # (x, y, sample_weight)
    b = PtqQuantizer(m2, cfg).calibrate(ds).get_modules_wrapper()[0].input_scale.numpy()
    np.testing.assert_array_equal(a, b)
    bad = x.copy()
    bad[5, 1] = np.inf
    m3 = keras.models.clone_model(m)
    with pytest.raises(ConfigError, match="contains NaN or inf"):
        PtqQuantizer(m3, cfg).calibrate(bad)


def test_exported_keras_files_compute_what_the_compressed_model_computes(tmp_path):
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    keras.utils.set_random_seed(5)
    x = keras.layers.Embedding(VOCAB, WIDTH)(ids)
    x = keras.layers.Dense(2 * WIDTH, activation="gelu", name="up")(x)
    x = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, WIDTH), name="down")(x)
    m = keras.Model(ids, keras.layers.Dense(VOCAB, name="lm")(x))
    SparseGPTPruner(m, [{"sparse_pattern": "2:4", **DEFAULT}]).calibrate(CALIB, progress=False)
    q = GptqQuantizer(m, [{"quant_bits": 4, "group_size": 16, **DEFAULT}]).calibrate(CALIB, progress=False)
    want = m(HELD).numpy()
    q.export_model(str(tmp_path / "q.keras"))
    loaded = keras.saving.load_model(str(tmp_path / "q.keras"))
    np.testing.assert_array_equal(loaded(HELD).numpy(), want)
    k = loaded.get_layer("down").kernel.numpy()  # [in, out]: 2:4 along the input axis, 4-bit grid per group
    assert ((k.T.reshape(WIDTH, -1, 4) != 0).sum(-1) <= 2).all()
    assert max(len(np.unique(k[g * 16:(g + 1) * 16, j])) for g in range(4) for j in range(WIDTH)) <= 15


# ------------------------------------------------------------------------------------------- AWQ search, rollback, range
def test_awq_block_search_gives_one_alpha_and_one_scale_vector_per_input_group():
    m = lm()
    a = AwqQuantizer(m, [{"quant_bits": 4, "group_size": 8, **DEFAULT}]).calibrate(CALIB, progress=False)
    rows = {r["layer"]: r for r in a.report()}
    ws = {w.name: w for w in a.modules_wrapper}
    for b in ("block0", "block1"):
        qkv = [f"{b}/attn/{n}" for n in ("query", "key", "value")]
        assert {rows[n]["group"] for n in qkv} == {qkv[0]} and len({rows[n]["alpha"] for n in qkv}) == 1
        for n in qkv[1:]:
            np.testing.assert_array_equal(ws[n].awq_scales.numpy(), ws[qkv[0]].awq_scales.numpy())
        for n in (f"{b}/attn/attention_output", f"{b}/up", f"{b}/down"):
            assert "group" not in rows[n]
    layer_mode = AwqQuantizer(lm(), [{"quant_bits": 4, "group_size": 8, "awq_search": "layer", **DEFAULT}])
    assert all("group" not in r for r in layer_mode.calibrate(CALIB, progress=False).report())


def _all_state(m, p):
    weights = [v.numpy().copy() for v in m.weights]
    states = {w.name: {n: v.numpy().copy() for n, v in w.state_variables().items()} for w in p.modules_wrapper}
    attrs = {w.name: sorted(a for a in vars(w) if a.startswith("weight_")) for w in p.modules_wrapper}
    return weights, states, attrs


def _same_state(a, b):
    (wa, sa, aa), (wb, sb, ab) = a, b
    assert len(wa) == len(wb) and all(np.array_equal(x, y) for x, y in zip(wa, wb))
    assert aa == ab and {k: sorted(v) for k, v in sa.items()} == {k: sorted(v) for k, v in sb.items()}
    for k in sa:
        for n in sa[k]:
            np.testing.assert_array_equal(sa[k][n], sb[k][n])


@pytest.mark.parametrize("cls,cfg", [(SparseGPTPruner, {"sparsity": 0.5}), (GptqQuantizer, {"quant_bits": 4}),
                                     (AwqQuantizer, {"quant_bits": 4, "group_size": 8})],
                         ids=["sparsegpt", "gptq", "awq"])
def test_calibrate_that_fails_in_block_two_leaves_every_weight_and_state_as_before(cls, cfg, monkeypatch):
    from compressor.tf.sequential import KerasOneShotBackend

    m = lm()
    p = cls(m, [{**cfg, **DEFAULT}])
    before = _all_state(m, p)
    write = KerasOneShotBackend.write

    def failing(self, task, result):
        if task.name == "block1/up":
            raise KeyboardInterrupt("interrupted in block 2")
        return write(self, task, result)

    monkeypatch.setattr(KerasOneShotBackend, "write", failing)
    with pytest.raises(KeyboardInterrupt, match="interrupted in block 2"):
        p.calibrate(CALIB, progress=False)
    _same_state(_all_state(m, p), before)
    assert not p.calibrated and list(p.rows) == []
    if cls is not GptqQuantizer:
        return
    monkeypatch.setattr(KerasOneShotBackend, "write", write)
    p.calibrate(CALIB, progress=False)  # works afterwards, as on a fresh model
    fresh = lm()
    cls(fresh, [{**cfg, **DEFAULT}]).calibrate(CALIB, progress=False)
    for x, y in zip(m.weights, fresh.weights):
        np.testing.assert_array_equal(x.numpy(), y.numpy())


def test_quant_range_full_uses_the_signed_int4_grid():
    for key, lo in (("full", -8), ("narrow", -7)):
        r = RtnQuantizer(lm(), [{"quant_bits": 4, "group_size": 8, "quant_range": key, **DEFAULT}]).calibrate(progress=False)
        codes = np.concatenate([oneshot_codes(w).ravel() for w in r.modules_wrapper])
        assert codes.min() == lo and codes.max() == 7
        for name in LAYERS:
            w, wrapper = canon(r, name)
            deq = oneshot_codes(wrapper).astype(np.float64) * np.repeat(wrapper.weight_group_scale.numpy(), 8, axis=1)
            np.testing.assert_array_equal(w, deq.astype(np.float32))
    with pytest.raises(ConfigError, match="quant_range"):
        GptqQuantizer(lm(), [{"quant_bits": 4, "quant_range": "wide", **DEFAULT}])


class _MaskedBlock(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.proj = keras.layers.Dense(WIDTH, name="proj")

    def call(self, x, tables=None, keep=None):
        cos, sin = tables
        return x + self.proj(x * cos[None] + sin[None]) * keep[None, :, None]


class _MaskedLM(keras.Model):
    """Each call makes its own keep mask / rotary-like tables (as a Llama's call), the same values on every batch
    of one length."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.embed = keras.layers.Embedding(VOCAB, WIDTH, name="embed")
        self.decoder = [_MaskedBlock(name=f"block{i}") for i in range(2)]

    def call(self, ids):
        n = ids.shape[1]
        tables = (tf.constant(np.linspace(0.5, 1.5, n * WIDTH, dtype=np.float32).reshape(n, WIDTH)),
                  tf.constant(np.full((n, WIDTH), 0.25, np.float32)))
        keep = tf.constant((np.arange(n) % 3 != 0).astype(np.float32))
        x = self.embed(ids)
        for b in self.decoder:
            x = b(x, tables=tables, keep=keep)
        return x


def test_block_inputs_share_repeated_arguments_and_advance_replaces_them_in_place():
    from compressor.tf.sequential import KerasOneShotBackend

    keras.utils.set_random_seed(0)
    m = _MaskedLM()
    m(CALIB[:1])
    p = SparseGPTPruner(m, [{"sparsity": 0.5, **DEFAULT}])
    be = KerasOneShotBackend(p, p._blocks)
    batches = [CALIB[:4], CALIB[4:8], CALIB[8:12, :9]]  # the last one shorter: its tables differ
    first = be.first_inputs(batches)
    assert first[1].kwargs["keep"] is first[0].kwargs["keep"] and first[1].kwargs["tables"] is first[0].kwargs["tables"]
    assert first[2].kwargs["keep"] is not first[1].kwargs["keep"] and first[2].kwargs["tables"] is not first[1].kwargs["tables"]
    assert first[1].hidden is not first[0].hidden
    for inp, b in zip(first, batches):  # the shared arguments hold what each batch's own call made
        np.testing.assert_array_equal(np.asarray(inp.hidden), m.embed(b).numpy())
    block = be.blocks()[0][1]
    seen = []
    assert be.run_block(block, first, {"block0/proj": lambda x: seen.append(x.shape)}) == []  # outputs dropped
    assert seen == [(48, WIDTH), (48, WIDTH), (36, WIDTH)]
    expected = [np.asarray(o.hidden) for o in be.run_block(block, first, None)]
    same = be.advance(block, first)
    assert same is first and len(first) == 3
    for inp, e in zip(first, expected):
        np.testing.assert_array_equal(np.asarray(inp.hidden), e)


@pytest.mark.parametrize("forward_dtype", ["float64", "model"])
def test_an_observing_call_ends_after_the_blocks_last_observed_input_with_the_same_result(forward_dtype, monkeypatch):
    """As on torch: from the second observing call of a block on, the call stops once the last observed layer
    (``down``) has handed over its input, so ``down`` computes n - 1 times less per block than with full calls;
    the compressed kernels are bit for bit the same."""
    import compressor.core.oneshot as seq

    data = [CALIB[i:i + 4] for i in range(0, 12, 4)]

    def run():
        m = lm()
        counts = []
        with _grabbing(m.decoder[0].down) as seen0, _grabbing(m.decoder[1].down) as seen1:
            SparseGPTPruner(m, [{"sparsity": 0.5, **DEFAULT}]).calibrate(data, progress=False,
                                                                           forward_dtype=forward_dtype)
            counts = [len(seen0), len(seen1)]
        return m, counts

    stopped, n_stopped = run()
    monkeypatch.setattr(seq.ObserveCalls, "fired", lambda self, name: False)
    full, n_full = run()
    assert [f - s for f, s in zip(n_full, n_stopped)] == [len(data) - 1] * 2
    for a, b in zip(full.weights, stopped.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
