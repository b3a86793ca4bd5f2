"""One-shot compression of a Hugging Face checkpoint, disk to disk, one decoder block in memory at a time:
``compressor.torch.oneshot(SRC_DIR, OUT_DIR, recipe, data)`` and ``compressor oneshot`` on the command line.

The model is built without weights (:class:`~compressor.torch.hf_stream.HfCheckpoint`: parameters on the meta
device), the recipe's compressors wrap it as they wrap any model, and the streamed driver
(:func:`compressor.core.oneshot.stream.run_streamed`) takes one block at a time: its weights are read from the
safetensors shards (memory-mapped), every stage of the recipe calibrates and compresses it, the compressed block
computes the next block's inputs, its compressed state goes to the run folder and its memory is released. Then
the compressed-tensors checkpoint is written a block per shard (:func:`compressor.torch.hf_checkpoint.plan_tensors`)
into a folder beside OUT_DIR that becomes OUT_DIR by one rename at the end.

The run folder, ``OUT_DIR.partial``, holds the progress (finished blocks, the recorded inputs of the next one,
the fingerprint of the recipe, checkpoint and data): the same command after a kill continues at the first
unfinished block and writes the same checkpoint as an uninterrupted run. SRC_DIR is only read.

What it holds in memory: one block's weights and its compressors' state, one batch of that block's calibration
activations (a block's recorded inputs are read back from the run folder a batch at a time, its outputs written
there as they are computed), that block's statistics. The embeddings and final norm are read only while block 0's
inputs are recorded, the head only when the checkpoint is written. The block passes run in the checkpoint's dtype
(``forward_dtype='model'``, the default here, as llmcompressor does); statistics are summed in float64
(:class:`~compressor.core.oneshot.statistics.GramAccumulator`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from io import BytesIO
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core.compressed_tensors import load_compressed_tensors, write_safetensors
from ..core.errors import ConfigError, ModelError
from ..core.oneshot import forward_in_float64, release_freed_heap
from ..core.oneshot.collective import split_evenly
from ..core.oneshot.stream import (
    BlockIO,
    RunStore,
    check_disk_space,
    check_folders,
    check_stages,
    run_streamed,
)
from ..core.recipe import build_compressors, load_recipe, recipe_hash
from ..core.token_data import calibration_tokens, cut_token_array
from .distributed import TorchCollective
from .hf_checkpoint import (
    TensorPlan,
    capture_call,
    dense_warning,
    plan_tensors,
    quantization_config,
    write_config,
)
from .hf_stream import HfCheckpoint
from .modules import is_wrapper
from .sequential import TorchOneShotBackend
from .sequential.blocks import _hidden_of, _Input
from .sequential.expert_banks import checkpoint_layout, fused_results, supported
from .token_data import checkpoint_tokenizer, load_token_file

__all__ = ["oneshot"]

#: files of a checkpoint folder that hold weights (the output writes its own)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _original_names(model: nn.Module) -> dict[str, str]:
    """Wrapped state_dict name -> the checkpoint's name, for every parameter and buffer of ``model``: a compressor
    wrapper keeps its layer as ``<layer>.module`` (nested wrappers: ``module.module``); the wrapper's own buffers
    (masks, codes) map to themselves and are in no checkpoint."""
    out: dict[str, str] = {}
    for mod_name, mod in model.named_modules():
        parts = mod_name.split(".") if mod_name else []
        orig, node = [], model
        for p in parts:
            if not (is_wrapper(node) and p == "module"):
                orig.append(p)
            node = getattr(node, p)
        for kind in ("_parameters", "_buffers"):
            for local, t in mod.__dict__.get(kind, {}).items():
                if t is None:
                    continue
                full = f"{mod_name}.{local}" if mod_name else local
                out[full] = ".".join([*orig, local]) if not is_wrapper(mod) or kind == "_parameters" else full
    return out


def _decoder_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's decoder layers: its longest ``nn.ModuleList`` whose children share one class (the rule the
    one-shot block finder applies)."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1:
            if best is None or len(m) > len(best[1]):
                best = (name, m)
    if best is None:
        raise ModelError("the model has no list of repeated decoder layers; a streamed run compresses block by block")
    return best


class _Checkpoint(BlockIO):
    """Blocks of the skeleton read from the source checkpoint and written to the run folder."""

    def __init__(self, ckpt: HfCheckpoint, model: nn.Module, names: dict[str, str], prefix_of: dict[int, str],
                 template: dict[str, torch.Tensor], lead: TorchOneShotBackend, probe_path: str, rank: int = 0) -> None:
        self.ckpt, self.model, self.names, self.prefix_of, self.template = ckpt, model, names, prefix_of, template
        self.lead, self.probe_path, self.rank = lead, probe_path, rank
        list_name = next(iter(prefix_of.values())).rsplit(".", 2)[0] if prefix_of else None
        #: parameters outside the decoder blocks, and those of the output head (unless tied to the input's)
        self.outside = [n for n, _ in model.named_parameters() if list_name is None or not n.startswith(list_name + ".")]
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
        self.head = {n for n, p in model.named_parameters() if n in self.outside and out_emb is not None
                     and p is getattr(out_emb, "weight", None) and (in_emb is None or p is not in_emb.weight)}

    def _fill(self, module: nn.Module, prefix: str, fresh: dict[str, torch.Tensor] | None) -> None:
        module.to_empty(device="cpu")
        with torch.no_grad():
            for kind in (module.named_parameters(), module.named_buffers()):
                for rel, t in kind:
                    key = self.names[prefix + rel]
                    if self.ckpt.holds(key):
                        t.copy_(self.ckpt.read(key))
                    elif fresh is not None and rel in fresh:
                        t.copy_(fresh[rel])
                    else:
                        raise ModelError(f"{key}: not in the checkpoint and no initial value for it")

    def load_block(self, block: nn.Module) -> None:
        self._fill(block, self.prefix_of[id(block)], self.template)

    def save_block(self, block: nn.Module, path: str) -> None:
        # the fused routed experts' codes / masks (kept per slice, outside the state) first: the writer packs them
        _save(_expert_results(block), path + EXPERTS_SUFFIX)
        _save(block.state_dict(), path)

    def release_block(self, block: nn.Module) -> None:
        block.to("meta")
        for m in block.modules():  # their codes / masks are in the run folder now
            if supported(m):
                fused_results(m).clear()

    def save_inputs(self, inputs: list[Any], path: str) -> None:
        _save([(c.args, c.kwargs, c.where, c.keep) for c in inputs], path)
        if inputs and self.rank == 0 and not os.path.exists(self.probe_path):
            # one sequence of a block's inputs, kept for writing: who reads what in a block (AWQ's folds) and
            # whether the folded weights compute what the compressed block does
            self.save_inputs_probe(inputs[0])

    def probe(self) -> _Input | None:
        return _Input(*torch.load(self.probe_path, weights_only=False)) if os.path.exists(self.probe_path) else None

    def load_inputs(self, path: str) -> list[Any]:
        # the run's own file (written by save_inputs above into the run folder): the call arguments of a block
        # hold the model's own objects (position embeddings, masks), hence a full unpickle
        return [_Input(*c) for c in torch.load(path, weights_only=False)]

    # the run reads a block's inputs back one batch at a time (core stream.RecordedInputs)
    def dump_input(self, inp: Any) -> bytes:
        buf = BytesIO()
        torch.save((inp.args, inp.kwargs, inp.where, inp.keep), buf)
        return buf.getvalue()

    def load_input(self, data: bytes) -> Any:
        return _Input(*torch.load(BytesIO(data), weights_only=False))  # the run's own record (see load_inputs)

    def inputs_recorded(self, first: Any) -> None:
        if self.rank == 0 and not os.path.exists(self.probe_path):
            self.save_inputs_probe(first)

    def save_inputs_probe(self, first: Any) -> None:
        c = first if self.lead.batch_rows(first) in (None, 1) else self.lead.take_rows(first, [0])
        _save((c.args, c.kwargs, c.where, c.keep), self.probe_path)

    def load_outside(self, head: bool = False) -> None:
        """The parameters outside the decoder blocks (embeddings, final norm; the head with ``head``), read."""
        for name in self.outside:
            if head or name not in self.head:
                _set(self.model, name, self.ckpt.read(name) if self.ckpt.holds(name)
                     else self.ckpt.read(_tied_source(self.model, name)))

    def release_outside(self) -> None:
        """... and back to the meta device: not in memory while the blocks run."""
        for name in self.outside:
            p = self.model.get_parameter(name)
            if p.device.type != "meta":
                _set(self.model, name, torch.empty_like(p, device="meta"))
        release_freed_heap()


#: beside a finished block's state in the run folder: its fused routed experts' results (codes, scales, masks)
EXPERTS_SUFFIX = ".experts"


def _expert_results(block: nn.Module) -> dict[str, dict[str, Any]]:
    """``{bank path in the block: {slice name: LayerResult}}`` of the fused routed experts a run compressed."""
    return {path: dict(fused_results(m)) for path, m in block.named_modules() if supported(m) and fused_results(m)}


def _restore_expert_results(block: nn.Module, path: str) -> None:
    """Put a finished block's fused-expert results back (from :meth:`_Checkpoint.save_block`'s file; a run folder
    of an older version has none: those experts are written as float)."""
    if not os.path.exists(path):
        return
    saved = torch.load(path, weights_only=False)  # the run's own file
    for bank_path, results in saved.items():
        bank = block.get_submodule(bank_path)
        fused_results(bank).clear()
        fused_results(bank).update(results)


def _save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _tokens(data: Any, src: str, num_samples: int, seq_len: int, vocab_size: int | None) -> np.ndarray:
    """The calibration token ids ``[num_samples, seq_len]``: from a file or folder (text through the checkpoint's
    tokenizer, ``.npy`` / ``.pt`` ids) or from an integer array / tensor."""
    if isinstance(data, (str, os.PathLike)):
        return calibration_tokens(data, num_samples=num_samples, seq_len=seq_len, tokenize=checkpoint_tokenizer(src),
                                  load_pt=load_token_file, vocab_size=vocab_size, what="--data")
    arr = data.detach().cpu().numpy() if torch.is_tensor(data) else np.asarray(data)
    return cut_token_array(arr, num_samples=num_samples, seq_len=seq_len, source="data", what="data",
                           vocab_size=vocab_size)


def _fingerprint(stages: Any, ckpt: HfCheckpoint, tokens: np.ndarray, options: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(recipe_hash(stages).encode())
    h.update(json.dumps(sorted((k, v[1], list(v[2])) for k, v in ckpt.tensors.items())).encode())
    h.update(str(tokens.shape).encode() + tokens.tobytes())
    h.update(json.dumps(options, sort_keys=True).encode())
    return h.hexdigest()


def _state_of(module: nn.Module, prefix: str, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """``module``'s compressed values under the checkpoint's names (tied parameters once): its parameters and the
    persistent buffers of its plain modules, not the compressors' own state (masks, codes)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for rel, p in module.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out[names[prefix + rel]] = p.detach()
    for mod_name, mod in module.named_modules():
        if is_wrapper(mod):
            continue
        for b, t in mod._buffers.items():
            if t is not None and b not in mod._non_persistent_buffers_set:
                rel = f"{mod_name}.{b}" if mod_name else b
                out[names[prefix + rel]] = t.detach()
    return out


def oneshot(src: str | os.PathLike[str], out: str | os.PathLike[str], recipe: Any, data: Any, *,
            num_samples: int = 128, seq_len: int = 512, batch_size: int = 8, forward_dtype: str = "model",
            sparse_format: str = "dense", workers: int = 1, threads: int | None = None,
            progress: Any = True) -> dict[str, Any]:
    """Compress the Hugging Face checkpoint ``src`` (config.json + safetensors), disk to disk with ``recipe`` (a YAML file, a
    YAML string or a list of ``{AlgorithmName: config_list}`` stages; the one-shot algorithms only) calibrated on
    ``data`` (a text file or folder, tokenized with the checkpoint's tokenizer.json; a ``.npy`` / ``.pt`` integer
    array ``[sequences, length]``; or such an array), ``num_samples`` sequences of ``seq_len`` tokens, and write a
    compressed-tensors checkpoint folder ``out`` that ``transformers`` loads. One decoder block is in memory at a
    time; a killed run continues where it stopped when called again. Returns a summary (sizes in and out, the
    per-layer report rows, seconds).

    ``workers``: processes to split the run over (started here; gloo on this machine): each calibrates on its
    share of the sequences, the statistics are summed over all, the layers of a block are solved by different
    processes and shared (see :mod:`compressor.core.oneshot.collective`). Called in every process of an
    initialised ``torch.distributed`` group (e.g. under ``torchrun``), the run is split over that group instead.
    ``threads``: torch threads per process (default: the CPUs divided by the processes)."""
    t0 = time.perf_counter()
    world = _torchrun_world()
    if world > 1 or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return _in_group(src, out, recipe, data, num_samples=num_samples, seq_len=seq_len, batch_size=batch_size,
                         forward_dtype=forward_dtype, sparse_format=sparse_format, threads=threads,
                         progress=progress, t0=t0)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers: a positive number of processes, got {workers!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads: a positive number of threads per process, got {threads!r}")
    prep = _prepare(src, out, recipe, data, num_samples, seq_len, batch_size, forward_dtype, workers)
    if workers == 1:
        with _threads(threads):
            return _run(prep, recipe, batch_size, forward_dtype, sparse_format, progress, None, t0)
    return _spawn(prep, recipe, workers, threads, batch_size, forward_dtype, sparse_format, progress, t0)


class _Prepared:
    """What a run reads before it starts, every check done: the folders, the recipe's stages, the checkpoint and
    the calibration tokens."""

    def __init__(self, src: str, out: str, stages: Any, ckpt: HfCheckpoint, tokens: np.ndarray) -> None:
        self.src, self.out, self.stages, self.ckpt, self.tokens = src, out, stages, ckpt, tokens


def _prepare(src: Any, out: Any, recipe: Any, data: Any, num_samples: int, seq_len: int, batch_size: int,
             forward_dtype: str, workers: int, first: bool = True) -> _Prepared:
    """Every refusal of a run, before anything is written (``first``: the process that may remove a finished run's
    leftover folder)."""
    what = "oneshot"
    src, out = check_folders(src, out, "checkpoint", what, first)
    stages = load_recipe(recipe, "torch", what="--recipe")
    ckpt = HfCheckpoint(src)
    tokens = _tokens(data, src, num_samples, seq_len, getattr(ckpt.config, "vocab_size", None))
    batches = -(-len(tokens) // batch_size) if isinstance(batch_size, int) and batch_size > 0 else 0
    if batches < workers:
        raise ConfigError(f"{what}: {workers} processes need at least {workers} calibration batches, there are "
                          f"{batches} ({len(tokens)} sequences, batch size {batch_size}): give more sequences, a "
                          f"smaller --batch-size or fewer --workers")
    check_disk_space(out, ckpt.nbytes, tokens.size, int(getattr(ckpt.config, "hidden_size", 0) or 0), what)
    forward_in_float64(forward_dtype, what, True)
    return _Prepared(src, out, stages, ckpt, tokens)


def _run(prep: _Prepared, recipe: Any, batch_size: int, forward_dtype: str, sparse_format: str, progress: Any,
         coll: Any, t0: float) -> dict[str, Any]:
    """The run in this process: all of it, or (``coll``: a :class:`~compressor.torch.distributed.TorchCollective`)
    this process's share, process 0 writing the run's state and the checkpoint."""
    src, out, stages, ckpt, tokens = prep.src, prep.out, prep.stages, prep.ckpt, prep.tokens
    what = "oneshot"
    float64 = forward_in_float64(forward_dtype, what, True)
    rank, world = (coll.rank, coll.world) if coll is not None else (0, 1)
    options = {"forward_dtype": forward_dtype, "sparse_format": sparse_format, "batch_size": batch_size,
               "workers": world}
    work = out + ".partial"

    with torch.no_grad():
        model = ckpt.skeleton()
        model.eval()
        list_name, layers = _decoder_list(model)
        first = layers[0]
        prefix0 = f"{list_name}.0."
        # the modules outside the blocks (embeddings, final norm, head) and block 0 are read before the
        # compressors wrap the model: block 0's wrappers then start from real values, the template of every block
        for name, _ in list(model.named_parameters()):
            if not name.startswith(f"{list_name}."):
                _set(model, name, ckpt.read(name) if ckpt.holds(name) else ckpt.read(_tied_source(model, name)))
        first.to_empty(device="cpu")
        for rel, t in [*first.named_parameters(), *first.named_buffers()]:
            if ckpt.holds(prefix0 + rel):
                t.copy_(ckpt.read(prefix0 + rel))
        compressors = build_compressors(
            stages, model, lambda: [n for n, m in model.named_modules() if isinstance(m, nn.Linear)], echo=rank == 0)
        names = _original_names(model)
        template = {rel: b.detach().clone() for rel, b in first.named_buffers() if not ckpt.holds(names[prefix0 + rel])}
        first.to("meta")
        prefix_of = {id(b): f"{list_name}.{i}." for i, b in enumerate(layers)}
        backends = [TorchOneShotBackend(c, None, float64) for c in compressors]
        if coll is not None:
            for be in backends:
                be.collective = coll
        io = _Checkpoint(ckpt, model, names, prefix_of, template, backends[0], os.path.join(work, "state", "probe"),
                         rank)
        io.release_outside()  # read again for block 0's inputs and for writing, not held while the blocks run
        found = [b for _, b in backends[0].blocks()]
        if [id(b) for b in found] != [id(b) for b in layers]:
            raise ModelError(f"{what}: the compressors' blocks are not the model's decoder layers {list_name!r}")
        stage_pairs = [(be, c.method_class()) for be, c in zip(backends, compressors)]
        batches = split_evenly([((), {"input_ids": t}) for t in torch.tensor(tokens).split(batch_size)], world, rank)
        check_stages(stage_pairs, batches)  # before the run folder is made
        key = _fingerprint(stages, ckpt, tokens, options)
        if rank == 0:
            store = RunStore(os.path.join(work, "state"), key, len(layers))
        if coll is not None:
            coll.barrier()
        if rank != 0:
            store = RunStore(os.path.join(work, "state"), key, len(layers), writer=False)
        rows = run_streamed(stage_pairs, io, batches, store, progress, samples=len(tokens))
        if rank != 0:
            return {"blocks": len(layers), "bytes_in": ckpt.nbytes, "bytes_out": None, "rows": rows,
                    "dense_notes": [], "seconds": time.perf_counter() - t0, "rank": rank}
        for c in compressors:
            c.calibrated = True
        plan = _write(ckpt, model, layers, list_name, names, store, io, os.path.join(work, "checkpoint"), src,
                      sparse_format)
    os.replace(os.path.join(work, "checkpoint"), out)
    shutil.rmtree(work, ignore_errors=True)
    size_out = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    if plan.dense_notes:  # as the in-memory export says it: these layers are not smaller in the file
        warnings.warn(f"compressor.torch.oneshot: {dense_warning(plan.dense_notes)}", UserWarning, stacklevel=3)
    return {"blocks": len(layers), "bytes_in": ckpt.nbytes, "bytes_out": size_out, "rows": rows,
            "dense_notes": plan.dense_notes, "seconds": time.perf_counter() - t0, "rank": 0}


def _torchrun_world() -> int:
    """The world size a launcher (``torchrun``) set in the environment, 1 when none did."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) if "MASTER_ADDR" in os.environ else 1
    except ValueError:
        return 1


#: the environment variables that size the thread pools of numpy's BLAS (the statistics and solves run there)
_BLAS_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


@contextlib.contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads, and numpy's BLAS threads where ``threadpoolctl`` can set them, limited to
    ``threads`` for the block (unchanged when None), put back after."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with _blas_threads(threads):
            yield
    finally:
        torch.set_num_threads(before)


def _blas_threads(threads: int) -> Any:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # numpy's BLAS keeps its own size (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS decide it)
        return contextlib.nullcontext()
    return threadpool_limits(limits=threads, user_api="blas")


def _in_group(src: Any, out: Any, recipe: Any, data: Any, *, num_samples: int, seq_len: int, batch_size: int,
              forward_dtype: str, sparse_format: str, threads: int | None, progress: Any, t0: float) -> dict[str, Any]:
    """The run split over the processes of ``torch.distributed``'s default group (initialised here, with gloo, from a
    launcher's environment when it is not yet); every process returns process 0's summary."""
    made = False
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", timeout=_GROUP_TIMEOUT)
        made = True
    try:
        coll = TorchCollective()
        # every process checks the input; process 0 alone may remove a finished run's leftovers
        prep = _prepare(src, out, recipe, data, num_samples, seq_len, batch_size, forward_dtype, coll.world,
                        first=coll.rank == 0)
        coll.barrier()
        with _threads(threads):
            summary = _run(prep, recipe, batch_size, forward_dtype, sparse_format, progress, coll, t0)
        summary = coll.broadcast_object(summary if coll.rank == 0 else None, 0)
        if made:
            coll.barrier()  # every process done with the group before any tears it down (gloo aborts otherwise)
        return summary
    finally:
        if made:
            torch.distributed.destroy_process_group()


#: how long a process waits in one collective for the others (a block's solve on a very large model on CPU can
#: take long; a process that dies is noticed by whoever started them: :func:`_spawn`, torchrun)
_GROUP_TIMEOUT = datetime.timedelta(hours=12)


def _spawn(prep: _Prepared, recipe: Any, workers: int, threads: int | None, batch_size: int, forward_dtype: str,
           sparse_format: str, progress: Any, t0: float) -> dict[str, Any]:
    """Run the prepared job in ``workers`` new processes (gloo over a file rendezvous); process 0's summary, or the
    first process's error, here."""
    per = threads if threads is not None else max(1, (os.cpu_count() or 1) // workers)
    # the processes' BLAS pools sized before they start (N processes with a pool of all CPUs each oversubscribe
    # the machine: measured 0.85x of one process on 2 cores), put back after
    saved = {k: os.environ.get(k) for k in _BLAS_THREAD_VARS}
    os.environ.update({k: str(per) for k in _BLAS_THREAD_VARS})
    try:
        return _spawned(prep, recipe, workers, per, batch_size, forward_dtype, sparse_format, progress, t0)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _spawned(prep: _Prepared, recipe: Any, workers: int, per: int, batch_size: int, forward_dtype: str,
             sparse_format: str, progress: Any, t0: float) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix=".oneshot-", dir=os.path.dirname(prep.out)) as d:
        args = (d, workers, per, prep.src, prep.out, recipe, prep.tokens, batch_size, forward_dtype, sparse_format,
                progress is not False and progress is not None, t0)
        failed: BaseException | None = None
        try:
            mp.start_processes(_worker, args=args, nprocs=workers, join=True, start_method="spawn")
        except Exception as e:  # noqa: BLE001 - a process's own error, read from its file below, says more
            failed = e
        results = []
        for r in range(workers):
            path = os.path.join(d, f"rank{r}.pkl")
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    for res in results:
        if res is not None and res[0] == "error":
            raise res[1]
    if failed is not None or results[0] is None:
        raise ModelError(f"oneshot: a worker process stopped ({failed}); the same command continues the run where "
                         f"it stopped")
    return results[0][1]


def _worker(rank: int, d: str, world: int, threads: int, src: str, out: str, recipe: Any, tokens: np.ndarray,
            batch_size: int, forward_dtype: str, sparse_format: str, progress: bool, t0: float) -> None:
    """One process of :func:`_spawn`: joins the group, runs its share, leaves its summary or its error in ``d``."""
    _die_with_parent()
    torch.set_num_threads(threads)
    _blas_threads(threads).__enter__()  # for the life of this process
    result: tuple[str, Any]
    try:
        torch.distributed.init_process_group("gloo", init_method="file://" + os.path.join(d, "rendezvous"),
                                             rank=rank, world_size=world, timeout=_GROUP_TIMEOUT)
        try:
            coll = TorchCollective()
            prep = _prepare(src, out, recipe, tokens, len(tokens), tokens.shape[1], batch_size, forward_dtype, world,
                            first=False)
            result = ("ok", _run(prep, recipe, batch_size, forward_dtype, sparse_format, progress, coll, t0))
            coll.barrier()  # every process done (process 0 writes the checkpoint last) before any leaves the group
        finally:
            torch.distributed.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - handed to the parent, which raises it
        result = ("error", e)
    _save(result, os.path.join(d, f"rank{rank}.pkl"))
    # leave without the interpreter's teardown: gloo's threads can meet C++ static destructors there and abort
    # the process ("terminate called without an active exception") after its work and its result file are done,
    # which the parent would report as a failed run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if result[0] == "error" else 0)


def _die_with_parent() -> None:
    """Linux: this process is killed when the process that started it dies (a killed run leaves no worker behind
    to write into the run folder while the next run starts)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _tied_source(model: nn.Module, name: str) -> str:
    """The checkpoint name holding a tied parameter absent from the file (``lm_head.weight`` -> the embedding's)."""
    target = model.get_parameter(name)
    for other, p in model.named_parameters(remove_duplicate=False):
        if p is target and other != name:
            return other
    raise ModelError(f"{name}: not in the checkpoint")


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, local = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    old = owner._parameters[local]
    new = nn.Parameter(value, requires_grad=False)
    # every module that shares this parameter (tied weights) gets the same new one
    for _, mod in model.named_modules():
        for k, p in list(mod._parameters.items()):
            if p is old:
                mod._parameters[k] = new


def _write(ckpt: HfCheckpoint, model: nn.Module, layers: Iterable[nn.Module], list_name: str, names: dict[str, str],
           store: RunStore, io: _Checkpoint, folder: str, src: str, sparse_format: str) -> TensorPlan:
    """The compressed-tensors checkpoint: one shard per block (read back from the run folder, planned, written,
    released), one for the rest, the index, config.json with its quantization_config, the source's other files."""
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    layers = list(layers)
    n_shards = len(layers) + 1
    weight_map: dict[str, str] = {}
    total = 0
    plan: TensorPlan | None = None

    def shard(i: int, part: TensorPlan) -> None:
        nonlocal total, plan
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        write_safetensors(os.path.join(folder, fname), part.tensors, {"format": "pt"}, bf16=part.bf16)
        for k, v in part.tensors.items():
            weight_map[k] = fname
            total += v.nbytes
        part.tensors = {}
        if plan is None:
            plan = part
        else:
            plan.merge(part)

    probe = io.probe()
    # the fused routed experts in transformers' per-expert layout, as the in-memory export writes them
    experts = checkpoint_layout(model)[0]
    for i, block in enumerate(layers):
        prefix = f"{list_name}.{i}"
        block.to_empty(device="cpu")
        block.load_state_dict(torch.load(store.block_path(i), weights_only=True))
        _restore_expert_results(block, store.block_path(i) + EXPERTS_SUFFIX)
        shard(i, _block_plan(block, prefix, _state_of(block, prefix + ".", names), names, probe, model.config,
                             sparse_format, experts))
        io.release_block(block)
        release_freed_heap()  # the block's copies are gone: their pages back to the OS before the next block's
    io.load_outside(head=True)
    rest = {k: v for k, v in _state_of(model, "", names).items() if not k.startswith(f"{list_name}.")}
    shard(len(layers), plan_tensors(_Part(model, "", list_name), rest, sparse_format, fold=False, experts={}))
    assert plan is not None
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    write_config(model, folder, quantization_config(plan))
    for f in sorted(os.listdir(src)):
        p = os.path.join(src, f)
        if os.path.isfile(p) and f != "config.json" and f not in _WEIGHT_FILES and not f.endswith(".safetensors"):
            shutil.copyfile(p, os.path.join(folder, f))
    return plan


class _Part(nn.Module):
    """A part of the model (one decoder block, or the model without its decoder layers ``skip``) under its names in
    the whole model, for planning its shard: only ``named_modules`` / ``named_parameters`` are asked of it."""

    def __init__(self, module: nn.Module, prefix: str, skip: str | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "_part", module)
        object.__setattr__(self, "_prefix", prefix)
        object.__setattr__(self, "_skip", skip)

    def _keep(self, rel: str) -> bool:
        return not self._skip or not (rel == self._skip or rel.startswith(self._skip + "."))

    def _full(self, rel: str) -> str:
        return ".".join(p for p in (self._prefix, rel) if p)

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return ((self._full(n), m) for n, m in self._part.named_modules() if self._keep(n))

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return ((self._full(n), p) for n, p in self._part.named_parameters(*args, **kwargs) if self._keep(n))


def _block_plan(block: nn.Module, prefix: str, state: dict[str, torch.Tensor], names: dict[str, str],
                probe: _Input | None, config: Any, sparse_format: str,
                experts: dict[str, Any] | None = None) -> TensorPlan:
    """One block's shard. With AWQ layers, their 1/s is folded into what produces their input (the block's norms,
    v / up projections) as the in-memory export does, who reads what found on ``probe`` (one recorded block call);
    then the folded weights must compute what the compressed block computes on it, else the block is written
    without folds (its AWQ layers in float, said in the notes)."""
    part = _Part(block, prefix)
    awq = any(is_wrapper(m) and "awq_scales" in m._buffers for m in block.modules())
    experts = {} if experts is None else experts
    if not awq or probe is None:
        return plan_tensors(part, state, sparse_format, fold=False, experts=experts)

    def capture(_: Any) -> Any:
        return capture_call(block, probe.args, probe.kwargs, prefix)
    plan = plan_tensors(part, state, sparse_format, fold=True, capture=capture, config=config, experts=experts)
    if plan.folded:
        err, tol = _fold_error(block, prefix, plan, names, probe)
        if err > tol:
            plan = plan_tensors(part, state, sparse_format, fold=False, experts=experts)
            plan.dense_notes.append(f"(the AWQ 1/s folds changed block {prefix}'s output by {err:.3g}, so none is "
                                    f"used there)")
    return plan


def _fold_error(block: nn.Module, prefix: str, plan: TensorPlan, names: dict[str, str],
                probe: _Input) -> tuple[float, float]:
    """Max |difference| of ``block``'s output on ``probe`` with the float weights the planned shard decodes to
    (folds applied) against the compressed block's, and the tolerance (float32 rounding of the folds); the block
    is put back as it was."""
    with tempfile.TemporaryDirectory() as d:
        write_safetensors(os.path.join(d, "model.safetensors"), plan.tensors, {"format": "pt"}, bf16=plan.bf16)
        with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
            json.dump({"quantization_config": quantization_config(plan)}, f)
        decoded = load_compressed_tensors(d)
    wrapped = {orig: full for full, orig in names.items() if full.startswith(prefix + ".")}
    saved = {k: v.clone() for k, v in block.state_dict().items()}
    ref = _hidden_of(block(*probe.args, **probe.kwargs)).float()
    try:
        for key, arr in decoded.items():
            full = wrapped.get(key)
            if full is not None:
                rel = full[len(prefix) + 1:]
                owner, _, local = rel.rpartition(".")
                mod = block.get_submodule(owner) if owner else block
                target = mod._parameters.get(local)
                (target if target is not None else mod._buffers[local]).copy_(torch.from_numpy(np.asarray(arr)))
        got = _hidden_of(block(*probe.args, **probe.kwargs)).float()
    finally:
        block.load_state_dict(saved)
    return float((got - ref).abs().max()), 1e-4 * (1.0 + float(ref.abs().max()))
