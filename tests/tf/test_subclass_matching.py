"""``'default'`` / ``'Dense'`` / ``'Linear'`` select subclasses of ``keras.layers.Dense`` defined outside Keras
(the wrappers run the subclass's own ``call`` with the compressed kernel), in layer selection and in the N:M
(2:4) checks."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from compressor.tf import LevelPruner, SparseGPTPruner  # noqa: E402
from compressor.tf.compressor import keras_base_type  # noqa: E402

pytestmark = [pytest.mark.tf]


class ScaledDense(keras.layers.Dense):
    """A Dense subclass with a call of its own (it still reads ``self.kernel``)."""

    def call(self, inputs):
        return super().call(inputs) * 0.5


class Plain(keras.layers.Layer):
    def call(self, inputs):
        return inputs


def _model():
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="a")(inp)
    h = ScaledDense(16, activation="relu", name="b")(h)
    h = Plain(name="c")(h)
    return keras.Model(inp, keras.layers.Dense(4, name="d")(h))


def test_base_type_names_the_keras_class_of_a_subclass():
    m = _model()
    assert [keras_base_type(m.get_layer(n)) for n in "abcd"] == [(), ("Dense",), (), ()]


@pytest.mark.parametrize("op_types", [["default"], ["Dense"], ["Linear"]])
def test_default_dense_and_linear_select_the_subclass(op_types):
    p = LevelPruner(_model(), [{"sparsity": 0.5, "op_types": op_types}])
    assert [i.name for i, _ in p.get_modules_to_compress()] == ["a", "b", "d"]


def test_2_4_on_the_subclass_keeps_its_own_call():
    model = _model()
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    p = SparseGPTPruner(model, [{"sparse_pattern": "2:4", "op_types": ["default"]}])
    p.calibrate([x], progress=False)
    names = [i.name for i, _ in p.get_modules_to_compress()]
    assert names == ["a", "b", "d"]
    k = np.asarray(model.get_layer("b").kernel)  # [in, out]: groups of 4 along the input axis
    nz = (k.T.reshape(16, -1, 4) != 0).sum(-1)
    assert (nz == 2).all()
    h = np.maximum(x @ np.asarray(model.get_layer("a").kernel) + np.asarray(model.get_layer("a").bias), 0)
    h = np.maximum((h @ k + np.asarray(model.get_layer("b").bias)) * 0.5, 0)  # the subclass's own call
    want = h @ np.asarray(model.get_layer("d").kernel) + np.asarray(model.get_layer("d").bias)
    np.testing.assert_allclose(np.asarray(model(x)), want, rtol=1e-5, atol=1e-5)
