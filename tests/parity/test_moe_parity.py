"""Routed-expert banks on both backends: a tiny Mixtral built in transformers (``MixtralForCausalLM``, fused 3-D
experts ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]) and in keras-hub (``MixtralBackbone``, expert bank
``expert_feedforward_{gate,intermediate,output}_dense`` [E, H, I] / [E, I, H]) with the same weights, calibrated on
the same tokens with ``forward_dtype='float64'``: every expert slice gets the same GPTQ codes and the same SparseGPT
mask on both (compressor/torch/sequential/expert_banks.py, compressor/tf/sequential/expert_banks.py).

Why the counts are exactly 0: each expert slice is solved from the Gram matrix of the tokens routed to it. The two
runs route the same tokens (the routers' logits agree to ~1e-15 in float64, far from any top-2 tie on random data)
and their Gram matrices agree to ~1e-7 relative (PyTorch runs its fused experts in float32 inside a float64 pass,
keras-hub rounds its SiLU to float32). A code or mask entry flips only where GPTQ's rounding argument or SparseGPT's
saliency sits within that of a decision boundary: with ~3e4 decisions per run and grid steps of ~1/16 of a group's
range, the expected number of flips is ~1e-2, so the bound is 0 (a flip would be a real divergence worth a look).

The torch slice ``gate_up_proj[e]`` holds Keras's gate rows then its intermediate (up) rows. SparseGPT runs with
``mask_scope: 'row'``: with the default 'block' scope its per-block threshold is taken over all rows of a layer, and
the torch side has ONE gate_up layer where Keras has two (gate, up), so the layers' masks legitimately differ."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
keras = pytest.importorskip("keras")
transformers = pytest.importorskip("transformers")
keras_hub = pytest.importorskip("keras_hub")

import compressor.tf as ctf  # noqa: E402
import compressor.torch as cth  # noqa: E402
from compressor.core.oneshot.experts import bank_results  # noqa: E402
from compressor.torch.sequential import expert_banks as fx  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.tf, pytest.mark.filterwarnings("ignore:.*leaves out weighted layers")]

V, H, FF, E, LAYERS, HEADS, KV = 64, 32, 48, 4, 2, 4, 2
HD = H // HEADS
CALIB = np.random.default_rng(2).integers(0, V, (8, 16))


def hf_mixtral():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=64,
                                     num_local_experts=E, num_experts_per_tok=2, rms_norm_eps=1e-5,
                                     tie_word_embeddings=False, rope_theta=10000.0)
    cfg._attn_implementation = "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.MixtralForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # unit-scale weights: logits of order 1, routing far from ties
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / (1.0 if "embed" in name else p.shape[-1] ** 0.5))
            else:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def keras_mixtral(tm):
    """keras-hub's Mixtral holding ``tm``'s weights (the mapping written out here)."""
    keras.utils.set_random_seed(0)
    bb = keras_hub.models.MixtralBackbone(vocabulary_size=V, num_layers=LAYERS, num_query_heads=HEADS,
                                          num_key_value_heads=KV, hidden_dim=H, intermediate_dim=FF, num_experts=E,
                                          top_k=2, rope_max_wavelength=10000, layer_norm_epsilon=1e-5,
                                          sliding_window=512)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in tm.state_dict().items()}
    bb.get_layer("token_embedding").embeddings.assign(sd["model.embed_tokens.weight"])
    bb.get_layer("token_embedding").reverse_embeddings.assign(sd["lm_head.weight"].T)
    bb.get_layer("sequence_output_layernorm").scale.assign(sd["model.norm.weight"])
    for i, ly in enumerate(bb.transformer_layers):
        p = f"model.layers.{i}."
        ly._self_attention_layernorm.scale.assign(sd[p + "input_layernorm.weight"])
        ly._feedforward_layernorm.scale.assign(sd[p + "post_attention_layernorm.weight"])
        att = ly._self_attention_layer
        att.query_dense.kernel.assign(sd[p + "self_attn.q_proj.weight"].T.reshape(H, HEADS, HD))
        att.key_dense.kernel.assign(sd[p + "self_attn.k_proj.weight"].T.reshape(H, KV, HD))
        att.value_dense.kernel.assign(sd[p + "self_attn.v_proj.weight"].T.reshape(H, KV, HD))
        att.output_dense.kernel.assign(sd[p + "self_attn.o_proj.weight"].T.reshape(HEADS, HD, H))
        moe = ly._sparse_moe_block
        moe._sparse_feedforward_gate_dense.kernel.assign(sd[p + "mlp.gate.weight"].T)
        gu = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
        bank = moe.expert_bank
        bank._expert_feedforward_gate_dense.assign(gu[:, :FF].transpose(0, 2, 1))
        bank._expert_feedforward_intermediate_dense.assign(gu[:, FF:].transpose(0, 2, 1))
        bank._expert_feedforward_output_dense.assign(sd[p + "mlp.experts.down_proj"].transpose(0, 2, 1))
    return bb


def keras_data(ids):
    return {"token_ids": ids.astype("int32"), "padding_mask": np.ones_like(ids, dtype="int32")}


def torch_logits(tm, ids):
    with torch.no_grad():
        return tm(input_ids=torch.from_numpy(ids)).logits.numpy()


def keras_logits(bb, ids):
    h = bb(keras_data(ids))
    return np.asarray(bb.token_embedding(h, reverse=True))


def twins():
    tm = hf_mixtral()
    return tm, keras_mixtral(tm)


def quiet(cls, model, cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(model, [{**cfg, "op_types": ["default"]}])


def torch_slices(tm, what):
    """``{(layer, expert): (gate+up, down)}`` of ``what`` ('codes' / 'mask') of the torch run's fused slices."""
    out = {}
    for i in range(LAYERS):
        path = f"model.layers.{i}.mlp.experts"
        got = fx.fused_results(tm.get_submodule(path))
        for e in range(E):
            gu, dn = got[f"{path}.{e}.gate_up_proj"], got[f"{path}.{e}.down_proj"]
            out[i, e] = tuple(r.quantized.codes if what == "codes" else r.mask for r in (gu, dn))
    return out


def keras_slices(bb, what):
    out = {}
    for i, ly in enumerate(bb.transformer_layers):
        bank = ly._sparse_moe_block.expert_bank
        got = bank_results(bank)
        path = f"transformer_layer_{i}/{ly._sparse_moe_block.name}/experts"
        for e in range(E):
            rs = [got[f"{path}/{e}/expert_feedforward_{n}_dense"] for n in ("gate", "intermediate", "output")]
            vals = [r.quantized.codes if what == "codes" else r.mask for r in rs]
            out[i, e] = (np.concatenate(vals[:2], axis=0), vals[2])
    return out


def differing(a, b):
    assert a.keys() == b.keys()
    total, diff = 0, 0
    for k in a:
        for x, y in zip(a[k], b[k]):
            assert x.shape == y.shape, (k, x.shape, y.shape)
            total += x.size
            diff += int(np.count_nonzero(np.asarray(x) != np.asarray(y)))
    return diff, total


def test_the_twins_compute_the_same_logits():
    tm, bb = twins()
    ref = torch_logits(tm, CALIB[:2])
    got = keras_logits(bb, CALIB[:2])
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("kind", ["gptq", "sparsegpt"])
def test_every_expert_slice_gets_the_same_codes_and_masks(kind):
    tm, bb = twins()
    if kind == "gptq":
        cfg, tcls, kcls, what = {"quant_bits": 4, "group_size": 16}, cth.GptqQuantizer, ctf.GptqQuantizer, "codes"
    else:
        cfg, tcls, kcls, what = ({"sparsity": 0.5, "mask_scope": "row"}, cth.SparseGPTPruner, ctf.SparseGPTPruner,
                                 "mask")
    t = quiet(tcls, tm, cfg).calibrate(torch.from_numpy(CALIB), progress=False, forward_dtype="float64")
    k = quiet(kcls, bb, cfg).calibrate(keras_data(CALIB), progress=False, forward_dtype="float64")
    diff, total = differing(torch_slices(tm, what), keras_slices(bb, what))
    assert total == LAYERS * E * (2 * FF * H + H * FF)
    print(f"{kind}: {diff} of {total} {what} entries differ")
    assert diff == 0, f"{diff} of {total} {what} entries differ"
    # every expert saw tokens on both sides: no fallback; the same slices in the same order
    slices = [[r["layer"].replace("/", ".") for r in rows if "experts" in r["layer"]] for rows in (t.oneshot_rows, k.rows)]
    assert not [r for r in list(t.oneshot_rows) + list(k.rows) if "fallback" in r]
    assert len(slices[0]) == LAYERS * E * 2 and len(slices[1]) == LAYERS * E * 3
    if kind == "sparsegpt":  # and the weights the models compute with: the same up to float32 storage
        for i, ly in enumerate(bb.transformer_layers):
            bank = ly._sparse_moe_block.expert_bank
            dn = tm.get_submodule(f"model.layers.{i}.mlp.experts").down_proj.detach().numpy()
            kd = np.asarray(bank._expert_feedforward_output_dense.numpy()).transpose(0, 2, 1)
            assert np.array_equal(kd == 0, dn == 0)
            np.testing.assert_allclose(kd, dn, rtol=0, atol=1e-5 * np.abs(dn).max())
