"""Routed experts held as FUSED 3-D parameters in a one-shot run (transformers 5's Mixtral / Qwen2-MoE / DeepSeek
``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``): each expert's slice of each
parameter is a layer of its own.

* **which**: a bank of experts that transformers' ``use_experts_implementation`` built (it carries ``has_gate``,
  ``is_transposed``, ``has_bias``; :func:`supported`), found by :func:`~.blocks.find_experts`. Its parameters
  ``gate_up_proj`` (``up_proj`` without a gate) and ``down_proj`` are matched against the config list as a
  ``Linear`` layer named ``<bank>.<param>`` (``op_names`` may also name the bank, ``<bank>.<param>`` or one slice
  ``<bank>.<e>.<param>``); the last matching entry wins, as for any layer. So ``op_types: ['default']`` compresses
  them; the routers stay float (they are not in the bank).
* **layout**: slice ``[e]`` is ``[out, in]`` (``F.linear``'s) unless the bank says ``is_transposed`` (GPT-OSS:
  ``[in, out]``); core sees the canonical ``[out, in]`` either way (:class:`FusedSlice`).
* **statistics**: while a block is observed, the bank's ``forward`` is replaced (an instance attribute, removed
  again when the pass ends, an exception or Ctrl-C included) by an equivalent per-expert loop that hands each
  expert's routed input rows to its gate/up slice's observer and the activations ``act(gate) * up`` of those rows
  to its down slice's observer (padded tokens left out where the batch has a 2-D ``attention_mask``). Each slice
  so gets its own Gram matrix / channel norms from the tokens its router sent it; an expert that got none falls
  back as core says (:mod:`compressor.core.oneshot.experts`: round to nearest / magnitude, one warning).
* **result**: the compressed slice is written into the 3-D parameter (the model computes with it at once); its
  mask / codes / scales are kept per slice (:func:`fused_results`) for export."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...core.oneshot import LayerResult, LayerTask
from ...core.oneshot.experts import (
    ExpertSlice,
    bank_results,
    compressed_banks,
    record_slice,
    restore_slice,
    slice_tasks,
    snapshot_slice,
)
from ...core.oneshot.experts import slice_mask as _slice_mask

__all__ = ["FusedSlice", "supported", "expert_loop", "fused_tasks", "fused_results", "observe_fused", "up_name", "slice_mask", "record",
           "snapshot", "restore", "export_notes", "ExpertPiece", "checkpoint_layout", "fuse_pieces"]



def up_name(bank: nn.Module) -> str:
    """The bank's first projection: ``gate_up_proj`` (gated experts) or ``up_proj``."""
    return "gate_up_proj" if getattr(bank, "has_gate", True) else "up_proj"


def supported(bank: nn.Module) -> bool:
    """A bank whose per-expert computation is known: built by transformers' ``use_experts_implementation``
    (``has_gate`` / ``is_transposed`` / ``has_bias`` attributes) with 3-D ``<up>`` and ``down_proj`` parameters."""
    if not all(hasattr(bank, a) for a in ("has_gate", "is_transposed", "has_bias")):
        return False
    ps = bank._parameters
    return all(isinstance(ps.get(n), torch.Tensor) and ps[n].dim() == 3 for n in (up_name(bank), "down_proj"))


class FusedSlice(ExpertSlice):
    """Expert ``expert``'s slice of the 3-D parameter ``param`` of the bank ``bank`` (at ``path``); a task handle
    named ``<path>.<expert>.<param>`` (core's :class:`~compressor.core.oneshot.experts.ExpertSlice`)."""

    def __init__(self, bank: nn.Module, path: str, param: str, expert: int):
        super().__init__(bank, path, param, expert)
        self.transposed = bool(getattr(bank, "is_transposed", False))

    def tensor(self) -> torch.Tensor:
        """The slice as stored (a view of the parameter)."""
        return self.bank._parameters[self.param][self.expert]

    def canonical(self) -> torch.Tensor:
        """The slice as ``[out, in]`` (a view)."""
        t = self.tensor()
        return t.t() if self.transposed else t

    def read(self) -> np.ndarray:
        return self.canonical().detach().to("cpu", torch.float64).numpy()

    def in_features(self) -> int:
        return int(self.canonical().shape[1])

    def stored(self) -> Any:
        """The slice as stored: a numpy view where numpy has the dtype (core's undo writes it out at once), else a
        CPU tensor copy (bfloat16)."""
        t = self.tensor().detach()
        return t.to("cpu").numpy() if t.dtype != torch.bfloat16 else t.to("cpu", copy=True)

    def put_back(self, stored: Any) -> None:
        with torch.no_grad():
            self.tensor().copy_(torch.from_numpy(stored) if isinstance(stored, np.ndarray) else stored)

    def assign(self, weight: np.ndarray | torch.Tensor) -> None:
        """Write a canonical ``[out, in]`` weight into the slice."""
        w = torch.as_tensor(np.ascontiguousarray(weight)) if isinstance(weight, np.ndarray) else weight
        dst = self.canonical()
        with torch.no_grad():
            dst.copy_(w.to(dtype=dst.dtype, device=dst.device))


def fused_tasks(compressor: Any, model: nn.Module, experts: list[Any]) -> list[LayerTask]:
    """One task per expert and fused parameter of the supported banks in ``experts`` (:class:`~.blocks.ExpertSet`)
    that the compressor's config list selects; each handle is marked as its routed expert's for core's fallback."""
    banks = []
    for s in experts:
        if not s.fused:
            continue
        bank = model.get_submodule(s.path)
        if supported(bank):
            banks.append((bank, s.path, (up_name(bank), "down_proj"), s.count))
    return slice_tasks(compressor.config_list, compressor.default_types, "Linear", banks, FusedSlice)


def fused_results(bank: nn.Module) -> dict[str, LayerResult]:
    """``{slice name: LayerResult}`` of the slices of ``bank`` a one-shot run wrote (mask, codes, AWQ scales)."""
    return bank_results(bank)


class _Restore:
    """A hook-handle-like object: ``remove()`` puts the bank's own ``forward`` back."""

    def __init__(self, bank: nn.Module, had: Any):
        self.bank, self.had = bank, had

    def remove(self) -> None:
        if self.had is None:
            self.bank.__dict__.pop("forward", None)
        else:
            self.bank.__dict__["forward"] = self.had


def expert_loop(bank: nn.Module, see: Callable[[int, str, torch.Tensor, torch.Tensor, int], None] | None = None,
                project: Callable[[int, str, torch.Tensor], torch.Tensor] | None = None,
                experts: int | None = None) -> Callable:
    """A ``forward(hidden_states, top_k_index, top_k_weights)`` for ``bank`` computing what transformers' eager
    experts compute, one expert at a time, calling ``see(expert, param, input rows, token indices, n)`` before each
    of the expert's two products (``n``: the rows of ``hidden_states``). ``project(expert, param, x)``: each
    product (bias included) computed by the caller instead of from the bank's 3-D parameters (packed experts,
    :class:`~compressor.torch.quantization.lowbit.PackedExperts`; ``experts``: their number then)."""
    up = up_name(bank)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        n = int(hidden_states.shape[0])
        if project is None:
            w1, w2 = bank._parameters[up], bank._parameters["down_proj"]
            b1 = getattr(bank, f"{up}_bias", None) if bank.has_bias else None
            b2 = getattr(bank, "down_proj_bias", None) if bank.has_bias else None

        def linear(e: int, param: str, x: torch.Tensor) -> torch.Tensor:
            if project is not None:
                return project(e, param, x)
            w, b = (w1[e], b1) if param == up else (w2[e], b2)
            y = x @ w if bank.is_transposed else F.linear(x, w)
            return y if b is None else y + b[e]

        for e in range(experts if project is not None else int(w1.shape[0])):
            tok, pos = torch.where(top_k_index == e)
            if not tok.numel():
                continue
            x = hidden_states[tok]
            if see is not None:
                see(e, up, x, tok, n)
            h = linear(e, up, x)
            h = bank._apply_gate(h) if bank.has_gate else bank.act_fn(h)
            if see is not None:
                see(e, "down_proj", h, tok, n)
            y = linear(e, "down_proj", h)
            if getattr(bank, "has_post_expert_norm", False):
                y = bank.post_expert_norm(y)
            y = y * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out
    return forward


def observe_fused(tasks: list[LayerTask], observe: dict[str, Callable[[Any], None]], keep: Callable[[], Any],
                  fired: Callable[[str], None], handles: list[Any]) -> None:
    """Install the per-expert loop on each bank holding an observed slice of ``tasks``: the rows of each slice's
    input go to ``observe[slice name]`` (float32 numpy ``[tokens, in]``, float64 kept; padded tokens left out where
    ``keep()``, the batch's ``[batch, seq]`` keep-mask, has one entry per row), then ``fired(name)`` (which may
    raise to end the call). A restoring handle per bank goes to ``handles`` BEFORE its forward is replaced."""
    banks: dict[int, tuple[nn.Module, dict[tuple[int, str], str]]] = {}
    for t in tasks:
        h = t.handle
        if isinstance(h, FusedSlice) and t.name in observe:
            banks.setdefault(id(h.bank), (h.bank, {}))[1][(h.expert, h.param)] = t.name
    for bank, names in banks.values():
        def see(e: int, param: str, x: torch.Tensor, tok: torch.Tensor, n: int, names: dict = names) -> None:
            name = names.get((e, param))
            if name is None:
                return
            k = keep()
            if k is not None and k.numel() == n:  # one keep entry per token of the flattened batch
                x = x[k.reshape(-1).to(x.device)[tok]]
            dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
            observe[name](x.detach().to("cpu", dtype).numpy().reshape(-1, x.shape[-1]))
            fired(name)
        handles.append(_Restore(bank, bank.__dict__.get("forward")))
        bank.forward = expert_loop(bank, see)


#: a slice's earlier keep-mask, recording its result, its undo copy: core's (one rule for both backends)
slice_mask = _slice_mask
record = record_slice
snapshot = snapshot_slice
restore = restore_slice


def export_notes(model: nn.Module, skip: Any = ()) -> list[str]:
    """For a compressed-tensors export: one note per bank of ``model`` whose slices a one-shot run compressed and
    that has no per-expert checkpoint layout (:func:`checkpoint_layout`; ``skip``: the banks' paths that have one).
    They are written as the float tensors they hold (pruned zeros / dequantized values) under the fused names:
    compressed-tensors packs ``nn.Linear`` layers only, and transformers loads the fused 3-D parameters as they are."""
    notes = []
    for path, _, got in compressed_banks(model.named_modules()):
        if path in skip:
            continue
        kinds = sorted({"quantized" if r.quantized is not None else "pruned" for r in got.values()})
        params = sorted({name.rsplit(".", 1)[1] for name in got})
        notes.append(f"{path}.{{{','.join(params)}}} (fused 3-D routed experts, {len(got)} slices {'+'.join(kinds)}: "
                     f"compressed-tensors packs Linear layers only; their compressed values are stored dense)")
    return notes


# ------------------------------------------------------------------------------- the checkpoint's per-expert layout
@dataclasses.dataclass(frozen=True, eq=False)
class ExpertPiece:
    """One per-expert tensor of a checkpoint in transformers' on-disk layout (what ``save_pretrained`` writes and
    ``from_pretrained`` merges back): the layer ``name`` (``model.layers.0.block_sparse_moe.experts.3.w1``; its
    tensor ``<name>.weight``, ``[rows, in]``) holds rows ``rows`` (a slice, or an index array where they are not
    consecutive) of expert ``expert``'s canonical ``[out, in]`` slice of the fused parameter ``param`` (a model key,
    ``model.layers.0.mlp.experts.gate_up_proj``, ``shape`` ``[E, out, in]``)."""

    name: str
    param: str
    expert: int
    rows: slice | np.ndarray
    shape: tuple[int, int, int]

    @property
    def n_rows(self) -> int:
        return len(range(*self.rows.indices(self.shape[1]))) if isinstance(self.rows, slice) else len(self.rows)


def _revert(model: nn.Module, probe: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """transformers' own save-time conversion (``revert_weight_conversion``: the inverse of what ``from_pretrained``
    applies) of the probe tensors, or None where this transformers has none or it fails on them."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    try:
        return revert_weight_conversion(model, dict(probe))
    except Exception:  # noqa: BLE001 - a conversion that needs real tensors: no layout is known
        return None


def _bank_pieces(model: nn.Module, key: str, bank: nn.Module, param: str) -> list[ExpertPiece] | None:
    """The per-expert pieces of the fused ``key``, found by converting an index probe with transformers' save-time
    conversion: each element ``[e, r, c]`` of a ``[E, out, 2]`` probe holds ``(e * out + r) * 2 + c`` (float64,
    exact), so each converted tensor names the expert and rows it took and shows its columns kept in order. None
    when the conversion leaves the name, transposes, or cuts the input columns (no per-expert layout is used)."""
    shape = tuple(int(d) for d in bank._parameters[param].shape)
    n_exp, n_out, _ = shape
    idx = torch.arange(n_exp * n_out, dtype=torch.float64).reshape(n_exp, n_out, 1) * 2
    got = _revert(model, {key: idx + torch.tensor([0.0, 1.0], dtype=torch.float64)})
    if not got or key in got:
        return None
    pieces: list[ExpertPiece] = []
    seen: dict[int, list[np.ndarray]] = {}
    for name, t in got.items():
        in_order = t.dim() == 2 and t.shape[1] == 2 and bool(((t[:, 1] - t[:, 0]) == 1).all())
        if not name.endswith(".weight") or not in_order:
            return None
        flat = (t[:, 0] / 2).long()
        experts = set((flat // n_out).tolist())
        if len(experts) != 1:
            return None
        e = experts.pop()
        r = (flat % n_out).numpy()
        seen.setdefault(e, []).append(r)
        consecutive = bool(len(r)) and np.array_equal(r, np.arange(r[0], r[0] + len(r)))
        rows: slice | np.ndarray = slice(int(r[0]), int(r[0]) + len(r)) if consecutive else r
        pieces.append(ExpertPiece(name[: -len(".weight")], key, e, rows, shape))  # type: ignore[arg-type]
    if sorted(seen) != list(range(n_exp)) or any(
            not np.array_equal(np.sort(np.concatenate(r)), np.arange(n_out)) for r in seen.values()):
        return None
    return pieces


def checkpoint_layout(model: nn.Module, renames: bool = False) -> tuple[dict[str, list[ExpertPiece]], dict[str, str]]:
    """How transformers' checkpoints of ``model`` (a ``PreTrainedModel``; a skeleton on the meta device will do)
    store its fused routed experts: ``{fused model key: [ExpertPiece]}`` for every supported, untransposed bank that
    its family's conversion mapping splits per expert (Mixtral: ``block_sparse_moe.experts.E.w1 / w3`` rows of
    ``gate_up_proj`` and ``w2`` = ``down_proj``; Qwen2-MoE and the families sharing its mapping: ``gate_proj`` /
    ``up_proj`` / ``down_proj``). With ``renames``: also ``{model key: checkpoint key}`` of the other tensors that
    the mapping renames (Mixtral's router ``mlp.gate`` is ``block_sparse_moe.gate`` on disk). Empty where
    transformers has no mapping for the model (the fused names are then the checkpoint's)."""
    experts: dict[str, list[ExpertPiece]] = {}
    banks: set[str] = set()
    for path, m in model.named_modules():
        if not supported(m) or getattr(m, "is_transposed", False):
            continue
        for param in (up_name(m), "down_proj"):
            key = f"{path}.{param}" if path else param
            banks.add(key)
            pieces = _bank_pieces(model, key, m, param)
            if pieces:
                experts[key] = pieces
    moved: dict[str, str] = {}
    if renames:
        keys = [k for k in model.state_dict(keep_vars=True) if k not in banks]
        got = _revert(model, {k: torch.tensor([float(i)], dtype=torch.float64) for i, k in enumerate(keys)})
        for name, t in (got or {}).items():
            if isinstance(t, torch.Tensor) and t.numel() == 1:
                i = int(t.reshape(-1)[0])
                if 0 <= i < len(keys) and keys[i] != name:
                    moved[keys[i]] = name
    return experts, moved


def fuse_pieces(tensors: dict[str, Any], layout: dict[str, list[ExpertPiece]]) -> dict[str, Any]:
    """``tensors`` (decoded weights by checkpoint name, numpy or torch) with every fused parameter whose per-expert
    pieces (``<piece>.weight``) are all there stacked back under its model key (the pieces removed); the others as
    they are."""
    out = dict(tensors)
    for key, pieces in layout.items():
        names = [f"{p.name}.weight" for p in pieces]
        if not all(n in out for n in names):
            continue
        first = out[names[0]]
        shape = pieces[0].shape
        if isinstance(first, torch.Tensor):
            fused = torch.empty(shape, dtype=first.dtype)
        else:
            fused = np.empty(shape, dtype=np.asarray(first).dtype)
        for p, n in zip(pieces, names):
            value = out.pop(n)
            rows = p.rows if isinstance(p.rows, slice) else torch.from_numpy(p.rows) if isinstance(
                fused, torch.Tensor) else p.rows
            if isinstance(fused, torch.Tensor):
                fused[p.expert][rows] = value.to(fused.dtype)
            else:
                fused[p.expert][rows] = np.asarray(value)
        out[key] = fused
    return out
