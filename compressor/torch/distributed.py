"""torch.distributed helpers: keep compression state identical on every rank.

Under DDP each rank sees different batches, so any statistic read from data (activation counts, Taylor
contributions, QAT activation ranges, LSQ's first-batch step size) differs per rank. The built-in
compressors reduce such statistics over the ranks with the collectives below BEFORE a mask or scale is
derived from them, so every rank computes the same masks and scales (and the same ones a single process
would compute on the concatenated global batch). Weight-only criteria need nothing: DDP keeps the
weights identical.

All helpers are no-ops when ``torch.distributed`` is unavailable or not initialised, work in place, and
never read tensors on the host (except :func:`unsynchronized`, a debugging check). Collectives must be
called by every rank in the same order; the built-in compressors call them from the optimizer hook and
from training-mode forwards, which DDP runs on all ranks in lockstep. Set ``compressor.sync_ranks = False``
to turn them off (e.g. when ranks deliberately train different models).
"""

from __future__ import annotations

import pickle
from io import BytesIO
from typing import Any

import numpy as np
import torch

from ..core.errors import ModelError
from ..core.oneshot.collective import Collective

__all__ = [
    "TorchCollective", "all_reduce_max", "all_reduce_mean", "all_reduce_min", "all_reduce_sum", "broadcast", "compression_tensors",
    "is_distributed", "rank", "refuse_wrapped_model", "sync_compressor", "unsynchronized", "world_size",
]


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a default process group is initialised."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world_size(group: Any = None) -> int:
    """Number of ranks (1 when not distributed)."""
    return torch.distributed.get_world_size(group) if is_distributed() else 1


def rank(group: Any = None) -> int:
    """This process's rank (0 when not distributed)."""
    return torch.distributed.get_rank(group) if is_distributed() else 0


def refuse_wrapped_model(model: torch.nn.Module, what: str) -> None:
    """DDP and FSDP capture the parameters and buffers of the model when they are built, and FSDP shards
    them; a compressor must instrument the plain model first. Refused (``ModelError``) by every compressor's
    constructor before anything changes."""
    kind = None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        kind = "DistributedDataParallel"
    elif torch.distributed.is_available():
        fsdp = getattr(torch.distributed, "fsdp", None)
        if fsdp is not None and isinstance(model, tuple(getattr(fsdp, n) for n in ("FullyShardedDataParallel", "FSDPModule")
                                                        if hasattr(fsdp, n))):
            kind = "FSDP"
    if kind is not None:
        raise ModelError(
            f"{what}: the model is wrapped in {kind}; compress the plain model first, then wrap it "
            f"(model = {what}(model, config_list, optimizer).compress(); model = {kind}(model, ...)). "
            f"See docs/guides/distributed.md"
        )


def _wire(t: torch.Tensor) -> torch.Tensor:
    """A view the backends can transport (gloo/NCCL have no bool reductions: bool travels as uint8)."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _all_reduce(op: str, tensors: tuple[torch.Tensor, ...], group: Any) -> None:
    if not is_distributed():
        return
    reduce_op = getattr(torch.distributed.ReduceOp, op)
    for t in tensors:
        if t is not None:
            torch.distributed.all_reduce(t, op=reduce_op, group=group)


def all_reduce_sum(*tensors: torch.Tensor, group: Any = None) -> None:
    """Replace each tensor by its sum over the ranks (in place)."""
    _all_reduce("SUM", tensors, group)


def all_reduce_mean(*tensors: torch.Tensor, group: Any = None) -> None:
    """Replace each float tensor by its mean over the ranks (in place)."""
    if not is_distributed():
        return
    all_reduce_sum(*tensors, group=group)
    n = world_size(group)
    for t in tensors:
        if t is not None:
            t.div_(n)


def all_reduce_min(*tensors: torch.Tensor, group: Any = None) -> None:
    """Replace each tensor by its element-wise minimum over the ranks (in place)."""
    _all_reduce("MIN", tensors, group)


def all_reduce_max(*tensors: torch.Tensor, group: Any = None) -> None:
    """Replace each tensor by its element-wise maximum over the ranks (in place)."""
    _all_reduce("MAX", tensors, group)


def broadcast(*tensors: torch.Tensor, src: int = 0, group: Any = None) -> None:
    """Overwrite each tensor with rank ``src``'s value (in place; bool tensors included)."""
    if not is_distributed():
        return
    for t in tensors:
        if t is not None:
            torch.distributed.broadcast(_wire(t), src=src, group=group)


def compression_tensors(compressor: Any) -> dict[str, torch.Tensor]:
    """The state a compressor keeps in its wrappers, by ``<layer>.<name>``: masks, quantization buffers
    (ranges, scales, zero points, flags) and the wrappers' own parameters (LSQ step sizes); not the
    layers' weights."""
    out: dict[str, torch.Tensor] = {}
    for wrapper in compressor.get_modules_wrapper():
        tensors = {**wrapper._buffers, **wrapper._parameters}
        for name, t in tensors.items():
            if t is not None:
                out[f"{wrapper.name}.{name}"] = t
    return out


def sync_compressor(compressor: Any, src: int = 0, group: Any = None) -> None:
    """Copy rank ``src``'s compression state (:func:`compression_tensors`) and schedule position
    (``compressor.state_dict()``) to every rank, then re-mask pruned layers.

    For custom compressors whose masks depend on per-rank data, or after loading a checkpoint on one
    rank only. The built-in ones keep ranks identical by themselves. A collective: call it on all ranks.
    """
    if not is_distributed():
        return
    with torch.no_grad():
        broadcast(*compression_tensors(compressor).values(), src=src, group=group)
    state = [compressor.state_dict()]
    torch.distributed.broadcast_object_list(state, src=src, group=group)
    compressor.load_state_dict(state[0])
    for wrapper in compressor.get_modules_wrapper():
        if hasattr(wrapper, "apply_masks"):
            wrapper.apply_masks()


def unsynchronized(compressor: Any, group: Any = None) -> list[str]:
    """Names of the compression tensors that are not bit-identical on every rank (``[]`` when all agree).

    A collective that reads results on the host: a check for tests and debugging, not for the training step.
    """
    tensors = compression_tensors(compressor)
    if not is_distributed() or not tensors:
        return []
    flags = []
    with torch.no_grad():
        for t in tensors.values():
            ref = t.detach().clone()
            broadcast(ref, src=0, group=group)
            flags.append(not torch.equal(_bits(ref), _bits(t.detach())))
    differs = torch.tensor(flags, dtype=torch.uint8, device=next(iter(tensors.values())).device)
    all_reduce_max(differs, group=group)
    return [name for name, d in zip(tensors, differs.tolist()) if d]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (compares -0.0/0.0 and NaN payloads exactly)."""
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)



class TorchCollective(Collective):
    """The processes of a one-shot run over ``torch.distributed`` (the default group, or ``group``): the statistics
    are host numpy arrays, reduced in place through CPU tensors sharing their memory, so the group's backend must
    handle CPU tensors (gloo; for NCCL give a gloo ``group`` made with ``torch.distributed.new_group(backend='gloo')``)."""

    def __init__(self, group: Any = None) -> None:
        if not is_distributed():
            raise ModelError("TorchCollective: torch.distributed is not initialised (init_process_group first)")
        self.group = group
        self.rank = rank(group)
        self.world = world_size(group)

    def sum_arrays(self, arrays: Any) -> None:
        for a in arrays:
            t = torch.from_numpy(a) if a.flags.c_contiguous and a.flags.writeable else torch.from_numpy(a.copy())
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=self.group)
            if t.data_ptr() != a.__array_interface__["data"][0]:
                a[...] = t.numpy()

    def sum_values(self, values: Any) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return t.tolist()

    def gather_values(self, value: int) -> list[int]:
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        torch.distributed.all_gather(out, torch.tensor([int(value)], dtype=torch.int64), group=self.group)
        return [int(t.item()) for t in out]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` pickled, except its numpy arrays of :data:`_OUT_OF_BAND_BYTES` or more, which travel as tensors
        (no pickled copy of a solved layer's weights and codes: 90 MiB per result of a TinyLlama down projection)."""
        arrays: list[np.ndarray] = []
        head = None
        if self.rank == src:
            buf = BytesIO()
            _ArrayPickler(buf, arrays).dump(obj)
            head = (buf.getvalue(), [(a.shape, a.dtype.str) for a in arrays])
        box = [head]
        torch.distributed.broadcast_object_list(box, src=src, group=self.group)
        data, metas = box[0]
        if self.rank != src:
            arrays = [np.empty(shape, dtype=np.dtype(dt)) for shape, dt in metas]
        for a in arrays:
            if a.size:
                torch.distributed.broadcast(torch.from_numpy(a.reshape(-1).view(np.uint8)), src=src, group=self.group)
        if self.rank == src:
            return obj
        unpickler = pickle.Unpickler(BytesIO(data))
        unpickler.persistent_load = lambda pid: arrays[pid]  # type: ignore[method-assign]
        return unpickler.load()

    def barrier(self) -> None:
        torch.distributed.barrier(group=self.group)


#: numpy arrays at least this large go out of band in :meth:`TorchCollective.broadcast_object`
_OUT_OF_BAND_BYTES = 1 << 20


class _ArrayPickler(pickle.Pickler):
    """Pickles an object with its large plain numpy arrays left out (collected in ``arrays``, referred to by their
    index; an array held twice goes once)."""

    def __init__(self, file: Any, arrays: list) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays = arrays
        self.index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if (type(obj) is np.ndarray and obj.nbytes >= _OUT_OF_BAND_BYTES and obj.flags.c_contiguous
                and obj.flags.writeable and not obj.dtype.hasobject and obj.dtype.fields is None):
            k = self.index.get(id(obj))
            if k is None:
                k = self.index[id(obj)] = len(self.arrays)
                self.arrays.append(obj)
            return k
        return None
