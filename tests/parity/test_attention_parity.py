"""Attention heads pruned by a filter pruner: the same self-attention block on torch (an HF-style module with
query/key/value Linear, ``num_attention_heads`` / ``attention_head_size``) and Keras (MultiHeadAttention)
with identical value weights -> the same heads pruned (L1 / L2 norms of the value filters summed per head,
floor(H * sparsity) per layer), equal to the numpy expectation; speedup removes them on both backends."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import torch
from torch import nn

import compressor.tf as ctf
import compressor.torch as cth

pytestmark = [pytest.mark.torch, pytest.mark.tf]

HIDDEN, HEADS, DIM, SEQ = 32, 4, 8, 6


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_attention_heads, self.attention_head_size = HEADS, DIM
        self.query, self.key, self.value = (nn.Linear(HIDDEN, HEADS * DIM) for _ in range(3))

    def forward(self, x):
        b, s, _ = x.shape

        def split(t):
            return t.view(b, s, self.num_attention_heads, self.attention_head_size).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.attention_head_size), dim=-1)
        return (a @ v).transpose(1, 2).reshape(b, s, -1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)  # puts the traced channels on the last axis (tokens x features)
        self.attn = SelfAttention()
        self.out = nn.Linear(HEADS * DIM, HIDDEN)
        self.fc = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        x = self.inp(x)
        return self.fc(x + self.out(self.attn(x)))


def keras_block(value_kernel, value_bias):
    keras.utils.set_random_seed(0)
    x = keras.layers.Dense(HIDDEN, name="inp")(inp := keras.Input((SEQ, HIDDEN)))
    mha = keras.layers.MultiHeadAttention(HEADS, DIM, name="attn")
    y = keras.layers.Add()([x, mha(x, x)])
    model = keras.Model(inp, keras.layers.Dense(3, name="fc")(y))
    mha._value_dense.kernel.assign(value_kernel)
    mha._value_dense.bias.assign(value_bias)
    return model


def expected(value_kernel, sparsity, criterion):
    per_channel = np.abs(value_kernel).sum(0) if criterion == "l1" else np.sqrt((value_kernel ** 2).sum(0))
    head = per_channel.sum(1)
    return sorted(np.argsort(head, kind="stable")[: int(HEADS * sparsity)].tolist())


@pytest.mark.parametrize("criterion", ["l1", "l2"])
@pytest.mark.parametrize("sparsity", [0.5, 0.3])
def test_same_heads_pruned_on_both_backends(criterion, sparsity):
    rng = np.random.default_rng(7)
    # quarter steps with distinct head norms: summation order cannot change the ranking
    vk = (np.round(rng.standard_normal((HIDDEN, HEADS, DIM)) * 4) / 4).astype(np.float32)
    vk[:, 2] *= 0.5
    vb = rng.uniform(-0.5, 0.5, (HEADS, DIM)).astype(np.float32)
    want = expected(vk, sparsity, criterion)
    assert len(want) == int(HEADS * sparsity)
    name = {"l1": "L1FilterPruner", "l2": "L2FilterPruner"}[criterion]

    torch.manual_seed(0)
    tm = Block().eval()
    with torch.no_grad():
        tm.attn.value.weight.copy_(torch.from_numpy(vk.reshape(HIDDEN, HEADS * DIM).T.copy()))
        tm.attn.value.bias.copy_(torch.from_numpy(vb.reshape(-1)))
    x = torch.randn(2, SEQ, HIDDEN)
    tp = getattr(cth, name)(tm, [{"sparsity": sparsity, "op_types": ["SelfAttention"]}], dependency_aware=True, dummy_input=x)
    tp.compress()
    [tw] = tp.get_modules_wrapper()
    t_kept = tw.weight_mask.numpy().reshape(HEADS, DIM, HIDDEN).all(axis=(1, 2))

    km = keras_block(vk, vb)
    kp = getattr(ctf, name)(km, [{"sparsity": sparsity, "op_types": ["MultiHeadAttention"]}],
                                 dependency_aware=True)
    kp.compress()
    [kw] = kp.get_modules_wrapper()
    k_kept = kw.weight_mask.numpy().all(axis=(0, 2))

    assert np.flatnonzero(~t_kept).tolist() == np.flatnonzero(~k_kept).tolist() == want
    assert (kw.weight_mask.numpy().transpose(1, 2, 0).reshape(HEADS * DIM, HIDDEN)
            == tw.weight_mask.numpy()).all()
    assert (kw.bias_mask.numpy().reshape(-1) == tw.bias_mask.numpy()).all()

    # speedup removes the same heads on both
    xs = np.random.default_rng(1).standard_normal((2, SEQ, HIDDEN)).astype(np.float32)
    kref = km.predict(xs, verbose=0)
    knew = ctf.speedup_model(kp)
    assert knew.get_layer("attn").get_config()["num_heads"] == HEADS - len(want)
    np.testing.assert_allclose(knew.predict(xs, verbose=0), kref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        tref = tm(torch.from_numpy(xs))
        small = cth.speedup_model(tp, x)
        assert small.attn.num_attention_heads == HEADS - len(want)
        assert tuple(small.attn.value.weight.shape) == ((HEADS - len(want)) * DIM, HIDDEN)
        np.testing.assert_allclose(small(torch.from_numpy(xs)).numpy(), tref.numpy(), rtol=1e-5, atol=1e-5)
