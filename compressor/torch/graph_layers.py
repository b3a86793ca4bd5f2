"""What the channel graph of :mod:`.graph` knows about a PyTorch layer: its kind (:func:`module_kind`), the
self-attention modules speedup cuts by whole heads (:func:`attention_spec`), its per-channel zero facts (read
off the current weights) and its multiply-accumulates per sample, also those of the matmuls and attention ops
the trace records outside layers (:func:`_matmul_macs`). No tracing here: :mod:`.graph` walks the model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..core.graph import conv_macs, linear_macs
from .families import is_in_out_linear
from .layout import is_grn
from .modules import innermost_module

__all__ = ["module_kind", "attention_spec"]


def module_kind(module: nn.Module) -> tuple[str, dict[str, Any]]:
    """Graph kind (and attrs) of a layer that owns parameters."""
    if isinstance(module, nn.modules.conv._ConvNd):
        if module.transposed:
            return "other", {}
        if module.groups == 1:
            return "conv", {}
        if module.groups == module.in_channels and module.out_channels % module.in_channels == 0:
            return "depthwise", {"multiplier": module.out_channels // module.in_channels}
        return "group_conv", {}
    if isinstance(module, nn.Linear) or _is_hf_conv1d(module):
        return "linear", {}
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "norm", {}
    if is_grn(module):  # per channel (channels last); the channel mean is kept by speedup (see _slice_grn)
        return "norm", {"channels_last": True}
    if isinstance(module, nn.Embedding):
        return "embedding", {}
    return "other", {}


#: (query, key, value, output projection or None) child names of the attention modules recognised
_ATTENTION_CHILDREN = (("query", "key", "value", None), ("q_proj", "k_proj", "v_proj", "o_proj"),
                       ("q_proj", "k_proj", "v_proj", "out_proj"))


def attention_spec(module: nn.Module) -> dict[str, Any] | None:
    """Heads of a self-attention module speedup can cut, or None.

    Recognised (HF transformers style, any class): ``query``/``key``/``value`` nn.Linear children with
    ``num_attention_heads`` and ``attention_head_size`` (BertSelfAttention, ...: the output is the
    context, ``heads * head_dim`` features, the output projection is another module), or
    ``q_proj``/``k_proj``/``v_proj`` + ``o_proj``/``out_proj`` nn.Linear children with
    ``num_attention_heads`` (or ``num_heads``) and ``head_dim`` (ViTAttention, ...: the output
    projection is inside). Query, key and value must all have ``heads * head_dim`` outputs (no grouped
    key/value heads) and cross-attention modules are left alone. ``torch.nn.MultiheadAttention`` is not
    recognised (its fused in-projection stays an ``other`` layer).

    Returns ``{'q', 'k', 'v', 'o'}`` (child names; ``'o'`` None when the projection is outside),
    ``heads``, ``head_dim``, and ``heads_attr`` / ``dim_attr`` (the attribute names read)."""
    m = innermost_module(module)
    if isinstance(m, (nn.Linear, nn.MultiheadAttention)) or "Cross" in type(m).__name__ \
            or getattr(m, "is_cross_attention", False):
        return None
    children = m._modules
    for q, k, v, o in _ATTENTION_CHILDREN:
        if q not in children or k not in children or v not in children or (o is not None and o not in children):
            continue
        if o is None:
            heads_attr, dim_attr = "num_attention_heads", "attention_head_size"
        else:
            heads_attr = "num_attention_heads" if hasattr(m, "num_attention_heads") else "num_heads"
            dim_attr = "head_dim"
        h, d = getattr(m, heads_attr, None), getattr(m, dim_attr, None)
        if not isinstance(h, int) or not isinstance(d, int) or h < 1 or d < 1:
            return None
        lins = [innermost_module(children[c]) for c in (q, k, v) + ((o,) if o else ())]
        if not all(type(x) is nn.Linear for x in lins):
            return None
        if any(x.out_features != h * d for x in lins[:3]) or len({x.in_features for x in lins[:3]}) != 1:
            return None
        if o is not None and lins[3].in_features != h * d:
            return None
        return {"q": q, "k": k, "v": v, "o": o, "heads": h, "head_dim": d,
                "heads_attr": heads_attr, "dim_attr": dim_attr}
    return None


def _is_hf_conv1d(module: nn.Module) -> bool:
    """A Linear stored ``[in, out]`` (HF ``Conv1D``; declared by a model-family plug-in)."""
    return is_in_out_linear(module)


def _prod(xs: Iterable[int]) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


# ---------------------------------------------------------------------------------- zero facts
@torch.no_grad()
def _facts(kind: str, m: nn.Module) -> dict[str, Any]:
    if kind == "attention":  # context channel j is zero when value output j is (a zero row, zero bias)
        return _facts("linear", innermost_module(m._modules[attention_spec(m)["v"]]))
    if kind in ("conv", "depthwise", "linear", "embedding"):
        w = m.weight.detach()
        if kind == "embedding":
            w = w.t()
        elif _is_hf_conv1d(m):
            w = w.t()  # stored [in, out]
        alive = (w.reshape(w.shape[0], -1) != 0).any(1)
        b = getattr(m, "bias", None)
        bias_zero = (b.detach() == 0) if torch.is_tensor(b) else torch.ones_like(alive)
        out = {"dead": ((~alive) & bias_zero).tolist()}
        if kind == "depthwise":
            out["passes_zero"] = bias_zero.tolist()
        return out
    if kind == "norm" and is_grn(m):  # x + gamma * x * N + beta: never zero whatever x; zero in -> beta out
        beta = m.bias.detach().reshape(-1).float().cpu()
        return {"dead": [False] * beta.numel(), "passes_zero": (beta == 0).tolist()}
    if kind == "norm":
        n = m.num_features
        gamma = m.weight.detach() if m.weight is not None else torch.ones(n)
        beta = m.bias.detach() if m.bias is not None else torch.zeros(n)
        gamma, beta = gamma.float().cpu(), beta.float().cpu()
        dead = (gamma == 0) & (beta == 0)
        if m.running_mean is not None and m.track_running_stats:
            shift = beta - m.running_mean.detach().float().cpu() * gamma / torch.sqrt(
                m.running_var.detach().float().cpu() + m.eps)
        else:  # batch statistics: a zero channel normalises to beta
            shift = beta
        return {"dead": dead.tolist(), "passes_zero": ((shift == 0) | dead).tolist()}
    return {}


def _rnn_macs(m: nn.RNNBase, out_shape: tuple[int, ...]) -> int:
    """Per sample: ``T * sum over layers and directions of gates * H * (in + H_r)`` (+ ``T * P * H`` per
    layer and direction for an LSTM projection), gates = 4 (LSTM), 3 (GRU), 1 (RNN); ``in`` = the input
    size for layer 0, ``dirs * H_r`` after; ``H_r`` = ``proj_size`` or ``hidden_size``."""
    gates = {"LSTM": 4, "GRU": 3}.get(m.mode, 1)
    if len(out_shape) == 3:
        steps = out_shape[1] if m.batch_first else out_shape[0]
    else:
        steps = out_shape[0] if out_shape else 1
    h = m.hidden_size
    proj = getattr(m, "proj_size", 0) or 0
    hr = proj or h
    dirs = 2 if m.bidirectional else 1
    total = 0
    for layer in range(m.num_layers):
        fin = m.input_size if layer == 0 else dirs * hr
        total += dirs * (gates * h * (fin + hr) + (proj * h if proj else 0))
    return int(steps) * total


def _mha_macs(m: nn.MultiheadAttention, in_shapes: list[tuple[int, ...]]) -> int:
    """Per sample: projections ``L*E*E + S*kdim*E + S*vdim*E + L*E*E`` plus the two attention matmuls
    ``Q @ K^T`` and ``attn @ V``, ``L*S*E`` each (``L``, ``S``: query and key lengths)."""
    if len(in_shapes) < 2:
        return 0
    q, k = in_shapes[0], in_shapes[1]
    axis = 1 if (m.batch_first and len(q) == 3) else 0
    seq_l, seq_s, e = int(q[axis]), int(k[axis]), m.embed_dim
    return seq_l * e * e + seq_s * (m.kdim + m.vdim) * e + 2 * seq_l * seq_s * e + seq_l * e * e


def _macs(kind: str, m: nn.Module, out_shape: tuple[int, ...], in_shapes: list | None = None) -> int:
    if isinstance(m, nn.RNNBase):
        return _rnn_macs(m, out_shape)
    if isinstance(m, nn.MultiheadAttention):
        return _mha_macs(m, in_shapes or [])
    if kind in ("conv", "depthwise", "group_conv"):
        nd = len(m.kernel_size)
        spatial = out_shape[-nd:] if len(out_shape) >= nd else ()
        return conv_macs(m.out_channels, m.in_channels, m.groups, _prod(m.kernel_size), _prod(spatial))
    if kind == "linear":
        if _is_hf_conv1d(m):
            fin, fout = m.weight.shape[0], m.weight.shape[1]
        else:
            fin, fout = m.in_features, m.out_features
        batch = out_shape[0] if len(out_shape) >= 2 else 1
        positions = _prod(out_shape) // max(fout, 1) // max(batch, 1)
        return linear_macs(fin, fout, positions)
    return 0


# ---------------------------------------------------------------------------------- ops outside layers
_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.bmm,
            torch.Tensor.bmm, torch.mm, torch.Tensor.mm, torch.nn.functional.scaled_dot_product_attention)


def _matmul_macs(func: Any, args: tuple, kwargs: dict) -> int:
    """MACs of one matmul (``[..., n, k] @ [..., k, m]``: ``batch * n * k * m``, batch dims broadcast) or
    of ``scaled_dot_product_attention`` (``Q @ K^T`` and ``attn @ V``: ``batch * L * S * (E + Ev)``; with
    grouped-query attention, fewer key/value heads than query heads (``enable_gqa``, Llama), each key/value
    head serves ``Hq / Hkv`` query heads: batch counts the query heads)."""
    ts = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
    if func is torch.nn.functional.scaled_dot_product_attention:
        if len(ts) < 3:
            return 0
        q, k, v = ts[0].shape, ts[1].shape, ts[2].shape
        qb, kb = list(q[:-2]), list(k[:-2])
        if qb and kb and kb[-1] and qb[-1] % kb[-1] == 0:  # grouped-query attention: key heads repeat
            kb[-1] = qb[-1]
        batch = torch.broadcast_shapes(tuple(qb), tuple(kb)).numel()
        return int(batch * q[-2] * k[-2] * (q[-1] + v[-1]))
    if len(ts) < 2:
        return 0
    a, b = ts[0].shape, ts[1].shape
    if func is torch.Tensor.__rmatmul__:
        a, b = b, a
    if len(a) == 0 or len(b) == 0:
        return 0
    n, k = (a[-2] if len(a) > 1 else 1), a[-1]
    m = b[-1] if len(b) > 1 else 1
    batch = torch.broadcast_shapes(a[:-2], b[:-2]).numel() if len(a) > 2 or len(b) > 2 else 1
    return int(batch * n * k * m)
