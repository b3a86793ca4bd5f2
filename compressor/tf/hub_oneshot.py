"""One-shot compression of a keras-hub preset, disk to disk, one decoder block in memory at a time:
``compressor.tf.oneshot(SRC_DIR, OUT_DIR, recipe, data)`` and ``compressor oneshot`` on the command line.

The backbone is built from ``config.json`` without weights (:class:`~compressor.tf.hub_stream.HubPreset`: every
Keras variable uninitialized), the recipe's compressors wrap it as they wrap any Keras model, and the streamed
driver (:func:`compressor.core.oneshot.stream.run_streamed`) takes one block at a time: its weights are read from
``model.weights.h5`` (Keras's own per-layer loader over h5py), every stage of the recipe calibrates and compresses
it, the compressed block computes the next block's inputs, then the block's layers become what stock Keras runs
(quantizers: Keras's own int4 / int8 / GPTQ / AWQ layers holding the codes, as
:func:`~compressor.tf.quantization.lowbit.to_keras_quantized` makes them; pruners: float weights with the zeros),
Keras's own weight saving writes the block to a file of the run folder, and its memory (weights, the
compressors' masks and codes) is released. At the end the output preset is assembled in a folder beside OUT_DIR
and renamed to OUT_DIR: ``config.json`` (quantized layers named in a ``DTypePolicyMap``, as keras-hub's
``Backbone.get_config`` writes it), ``model.weights.h5`` (the layers outside the blocks, then each block's file
copied in), ``task.json`` with that backbone config, and the preset's other files (``metadata.json``,
``task.weights.h5``, ``tokenizer.json``, ``preprocessor.json``, ``assets/``) copied. keras-hub loads it without
compressor: ``keras_hub.models.CausalLM.from_preset(OUT_DIR)`` or ``keras_hub.models.Backbone.from_preset``.

The run folder, ``OUT_DIR.partial``, holds the progress (finished blocks, the recorded inputs of the next one,
the fingerprint of the recipe, preset and data): the same call after a kill continues at the first unfinished
block and writes the same preset, byte for byte, as an uninterrupted run. SRC_DIR is only read.

What it holds in memory: the layers outside the blocks (embeddings, final norm; read once), one block's weights
and its compressors' state, the calibration activations of one block, that block's statistics. The block passes
run in the preset's dtype (``forward_dtype='model'``, the default, as llmcompressor does); statistics are summed
in float64.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.saving import saving_lib

from ..core.errors import ConfigError, ConfigWarning, ModelError
from ..core.oneshot import forward_in_float64, release_freed_heap
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
from .calibration_data import calibration_batches
from .compressor import iter_layers, strip_model
from .hub_stream import (
    CONFIG_FILE,
    SHARDED_WEIGHTS_FILE,
    TASK_FILE,
    TASK_WEIGHTS_FILE,
    WEIGHTS_FILE,
    HubPreset,
    record_saveables,
)
from .pruning.wrapper import PrunerLayerWrapper
from .quantization.lowbit import to_keras_quantized
from .sequential import KerasOneShotBackend
from .sequential.blocks import BlockInput, remapper_off

__all__ = ["oneshot", "preset_tokenizer"]

#: the backbone inputs a streamed run feeds: token ids, and a padding mask of ones
_INPUTS = ("token_ids", "padding_mask")
#: attribute of a block file naming its groups in the order Keras wrote them, and the dtype policies of its
#: quantized layers
_ORDER_ATTR = "compressor_order"
_POLICY_ATTR = "compressor_policies"


# ------------------------------------------------------------------------------------------------ data
def preset_tokenizer(src_dir: str | os.PathLike[str]) -> Any:
    """A function ``text -> token ids`` with the preset's own keras-hub tokenizer (``tokenizer.json`` and its
    ``assets/``; no special tokens are added), or None when the preset has no ``tokenizer.json``."""
    if not os.path.isfile(os.path.join(os.fspath(src_dir), "tokenizer.json")):
        return None
    try:
        import keras_hub

        tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(os.fspath(src_dir))
    except Exception as e:  # noqa: BLE001 - keras-hub raises ValueError, KeyError, OSError, ImportError ...
        raise ConfigError(f"{os.path.join(os.fspath(src_dir), 'tokenizer.json')!r}: keras-hub cannot load the "
                          f"preset's tokenizer ({type(e).__name__}: {str(e)[:300]})") from None

    def tokenize(text: str) -> list[int]:
        return np.asarray(tokenizer(text)).reshape(-1).tolist()

    return tokenize


def _tokens(data: Any, src: str, num_samples: int, seq_len: int, vocab_size: int | None) -> np.ndarray:
    """The calibration token ids ``[num_samples, seq_len]``: from a file or folder (text through the preset's
    tokenizer, ``.npy`` ids) or from an integer array."""
    if isinstance(data, (str, os.PathLike)):
        return calibration_tokens(data, num_samples=num_samples, seq_len=seq_len, tokenize=preset_tokenizer(src),
                                  vocab_size=vocab_size, what="--data")
    arr = data.numpy() if isinstance(data, tf.Tensor) else np.asarray(data)
    return cut_token_array(arr, num_samples=num_samples, seq_len=seq_len, source="data", what="data",
                           vocab_size=vocab_size)


def _batches(model: Any, tokens: np.ndarray, batch_size: int) -> list[Any]:
    """The backbone's calibration batches, ``{'token_ids', 'padding_mask'}`` (a mask of ones), cut as the
    in-memory ``calibrate`` cuts them (:func:`~compressor.tf.calibration_data.calibration_batches`)."""
    names = [getattr(t, "name", "").split(":")[0] for t in model.inputs]
    if sorted(names) != sorted(_INPUTS):
        raise ModelError(f"the backbone takes the inputs {names}; a streamed run feeds a language model's "
                         f"{list(_INPUTS)}")
    ids = tokens.astype(np.int32)
    data = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    return list(calibration_batches(data, what="--data", batch_size=batch_size, n_inputs=len(names)))


# ----------------------------------------------------------------------------------------- block files
class _BlockWriter(saving_lib.H5IOStore):
    """Keras's weights store writing one block's groups to a file of its own; it notes the groups in the order
    Keras made them (kept in the file, so the output is assembled in that order)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, mode="w")
        self.order: list[list[Any]] = []

    def make(self, path: str, metadata: dict[str, Any] | None = None) -> _BlockWriter:
        self.order.append([path, (metadata or {}).get("name"), []])
        return super().make(path, metadata)

    def __setitem__(self, key: str, value: Any) -> None:
        self.order[-1][2].append(key)
        super().__setitem__(key, value)


class _OutputWriter(saving_lib.H5IOStore):
    """Keras's weights store, writing groups and datasets without HDF5's creation / modification times (which
    h5py records by default), each group named as in the source file (``names``: a layer without a name of
    its own is named by a process-wide counter, e.g. ``'dropout_3'``): the same weights give the same bytes,
    whenever and however often the run stopped."""

    def __init__(self, path: str, names: dict[str, str]) -> None:
        super().__init__(path, mode="w")
        self.names = names

    def _create_h5_group(self, path: str, metadata: dict[str, Any] | None = None) -> None:
        if metadata and "name" in metadata and path in self.names:
            metadata = {**metadata, "name": self.names[path]}
        group = self.h5_file
        for part in [*(path.split("/") if path else []), "vars"]:
            group = group[part] if part in group else _untimed_group(group, part)
        for k, v in (metadata or {}).items():
            group.attrs[k] = v
        self._h5_entry_group = group
        self._h5_entry_initialized = True

    def __setitem__(self, key: str, value: Any) -> None:
        if not self._h5_entry_initialized:
            self._create_h5_group(self._h5_entry_path)
        value = keras.ops.convert_to_numpy(value)
        ds = self._h5_entry_group.create_dataset(key, data=value, track_times=False)
        if keras.backend.standardize_dtype(value.dtype) == "bfloat16":
            ds.attrs["dtype"] = "bfloat16"


def _untimed_group(parent: Any, name: str) -> Any:
    import h5py

    gcpl = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(False)
    return h5py.Group(h5py.h5g.create(parent.id, name.encode("utf-8"), gcpl=gcpl))


def _sync(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _to_arrays(obj: Any, memo: dict[int, Any]) -> Any:
    """``obj`` (a block call's arguments) with its tensors as numpy arrays; one tensor shared by several calls
    becomes one array (pickle keeps the sharing)."""
    if isinstance(obj, (tf.Tensor, tf.Variable)) or (hasattr(obj, "shape") and hasattr(obj, "dtype")
                                                      and not isinstance(obj, np.ndarray)):
        if id(obj) not in memo:
            memo[id(obj)] = (obj, _Tensor(np.asarray(obj)))
        return memo[id(obj)][1]
    if isinstance(obj, tuple):
        return tuple(_to_arrays(x, memo) for x in obj)
    if isinstance(obj, list):
        return [_to_arrays(x, memo) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_arrays(v, memo) for k, v in obj.items()}
    return obj


def _to_tensors(obj: Any, memo: dict[int, Any]) -> Any:
    if isinstance(obj, _Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = tf.convert_to_tensor(obj.array)
        return memo[id(obj)]
    if isinstance(obj, tuple):
        return tuple(_to_tensors(x, memo) for x in obj)
    if isinstance(obj, list):
        return [_to_tensors(x, memo) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_tensors(v, memo) for k, v in obj.items()}
    return obj


class _Tensor:
    """A tensor of a recorded block call, as numpy (an array argument would stay an array)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array


def _save_pickle(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _PresetIO(BlockIO):
    """The streamed run's storage over a keras-hub preset: blocks read from the weights file, written (as stock
    Keras layers) to the run folder's block files."""

    def __init__(self, preset: HubPreset, blocks: Sequence[Any], paths: dict[int, str],
                 wrappers: dict[int, list[Any]], backends: Sequence[KerasOneShotBackend]) -> None:
        self.preset, self.blocks, self.paths, self.wrappers = preset, list(blocks), paths, wrappers
        self.backends = list(backends)

    def load_block(self, block: Any) -> None:
        self.preset.load(block, self.paths[id(block)])
        for w in self.wrappers[id(block)]:  # the compressors' state starts fresh, as on an unread model
            _drop_state(w)
            if isinstance(w, PrunerLayerWrapper):
                w._create_masks()

    def save_block(self, block: Any, path: str) -> None:
        wrappers = self.wrappers[id(block)]
        if any("weight_codes" in w.state_variables() for w in wrappers):
            to_keras_quantized(block)  # Keras's own low-bit layers; every wrapper of the block goes
        else:
            strip_model(block)  # pruned: the kernels hold the zeros
        for w in wrappers:
            _drop_state(w)
        policies = {layer.path: keras.dtype_policies.serialize(layer.dtype_policy)
                    for layer in block._flatten_layers(include_self=True, recursive=True)
                    if getattr(layer.dtype_policy, "quantization_mode", None)}
        tmp = path + ".tmp"
        writer = _BlockWriter(tmp)
        try:
            saving_lib._save_state(block, weights_store=writer, assets_store=None, inner_path=self.paths[id(block)],
                                   visited_saveables=set())
            writer.h5_file.attrs[_ORDER_ATTR] = json.dumps(writer.order)
            writer.h5_file.attrs[_POLICY_ATTR] = json.dumps(policies, sort_keys=True)
        finally:
            writer.close()
        _sync(tmp)
        os.replace(tmp, path)

    def release_block(self, block: Any) -> None:
        for w in self.wrappers[id(block)]:
            _drop_state(w)
        for backend in self.backends:  # traced block / layer functions hold the variables they read
            backend._compiled.clear()
        self.preset.release(block)

    def save_inputs(self, inputs: list[Any], path: str) -> None:
        memo: dict[int, Any] = {}
        _save_pickle([(_to_arrays(c.args, memo), _to_arrays(c.kwargs, memo), c.key) for c in inputs], path)

    def load_inputs(self, path: str) -> list[Any]:
        # the run's own file (written by save_inputs above into the run folder)
        with open(path, "rb") as f:
            calls = pickle.load(f)  # noqa: S301
        memo: dict[int, Any] = {}
        return [BlockInput(_to_tensors(a, memo), _to_tensors(k, memo), key) for a, k, key in calls]


def _drop_state(w: Any) -> None:
    """Remove a wrapper's state variables (masks, codes, scales): their memory goes with them."""
    states = w.__dict__["_state_vars"]
    for n in list(states):
        del states[n]
        delattr(w, n)  # through the trackable, which drops its dependency on the variable too


# ------------------------------------------------------------------------------------------------ run
def _fingerprint(stages: Any, preset: HubPreset, tokens: np.ndarray, options: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(recipe_hash(stages).encode())
    h.update(json.dumps(preset.config, sort_keys=True).encode())
    h.update(json.dumps(sorted((k, list(v[1]), v[2]) for k, v in preset.datasets.items())).encode())
    h.update(str(tokens.shape).encode() + tokens.tobytes())
    h.update(json.dumps(options, sort_keys=True).encode())
    return h.hexdigest()


def _check_keras_layouts(stages: Any) -> None:
    """Refuse, before anything is read, a quantizer grid stock Keras has no layer for (AWQ codes over 4 bits)."""
    for i, stage in enumerate(stages):
        if stage.name != "AwqQuantizer":
            continue
        for c in stage.normalized:
            bits = c.get("quant_bits")
            bits = bits.get("weight") if isinstance(bits, dict) else bits
            if not c["exclude"] and bits is not None and int(bits) > 4:
                raise ConfigError(f"--recipe: stage {i} (AwqQuantizer): {bits}-bit AWQ codes have no stock Keras layer "
                                  f"(Keras's AWQ layer holds at most 4 bits); use quant_bits <= 4, or GptqQuantizer / "
                                  f"RtnQuantizer for wider codes")


def _check_conversions(stages: Any, compressors: Sequence[Any], first: Sequence[Any]) -> None:
    """Every layer a quantizer compresses has a stock Keras layer for its grid that a preset can describe (not: a
    3-D EinsumDense kernel that Keras's GPTQ layer would split otherwise than ours, AWQ codes over 4 bits, codes
    for Keras's int8 layer, which a preset's config rebuilds with activation quantization): checked on the
    first block's layers with placeholder codes (``keras_quantized_variables`` changes nothing), before anything
    is run."""
    from .quantization.lowbit import keras_quantized_variables
    from .quantization.oneshot import AwqQuantizer

    for i, (stage, c) in enumerate(zip(stages, compressors)):
        if not getattr(type(c), "holds_integer_codes", False):
            continue
        for w in c.modules_wrapper:
            if w not in first:
                continue
            spec, plan = c._specs[w.name], c._layouts[w.name]
            gs = spec.group_size if spec.group_size and 0 < spec.group_size < plan.n_in else plan.n_in
            groups = -(-plan.n_in // gs)
            try:
                mode = keras_quantized_variables(
                    w.name, w.layer, np.zeros((plan.n_out, plan.n_in), np.int32), np.ones((plan.n_out, groups)),
                    np.zeros((plan.n_out, groups)), spec.group_size or -1, spec.bits, spec.symmetric,
                    awq_scales=np.ones(plan.n_in) if isinstance(c, AwqQuantizer) else None).mode
            except ConfigError as e:
                raise ConfigError(f"--recipe: stage {i} ({stage.name}): {e}") from None
            if mode == "int8":
                raise ConfigError(f"--recipe: stage {i} ({stage.name}): layer {w.name!r}: {spec.bits}-bit symmetric "
                                  f"codes per output channel go into Keras's int8 layers, whose weight-only setting "
                                  f"a keras-hub preset cannot record (its config keeps the dtype policy only, and "
                                  f"keras-hub would rebuild them quantizing the activations too); give a group_size "
                                  f"or quant_scheme: affine (Keras's GPTQ layer holds those codes, weight-only)")


def _compressors(model: Any, stages: Any) -> list[Any]:
    """The recipe's compressors on ``model``; an op_names / op_types entry that matches no layer is an error
    (in memory it is a warning; here it would cost a whole run to notice)."""
    def hint(message: str) -> str:
        return (" (a Keras model has no 'lm_head' layer: keras-hub's LM head is the token embedding, which the "
                "one-shot compressors leave out; drop that entry)") if "lm_head" in message else ""

    out = build_compressors(stages, model, lambda: [p for p, layer in iter_layers(model) if isinstance(
        layer, (keras.layers.Dense, keras.layers.EinsumDense))], "preset", hint)
    for i, stage in enumerate(stages):
        linear = [c for c in stage.normalized if not c["exclude"] and "Linear" in c.get("op_types", ())
                  and not {"EinsumDense", "default"} & set(c.get("op_types", ()))]
        einsum = [p for p, layer in iter_layers(model) if isinstance(layer, keras.layers.EinsumDense)]
        if linear and einsum:
            warnings.warn(f"--recipe: stage {i} ({stage.name}): op_types 'Linear' means Keras's Dense layers only; "
                          f"the attention projections of this preset are EinsumDense layers (e.g. {einsum[0]!r}) and "
                          f"are left as they are; give op_types [default] (Dense and EinsumDense) to compress them",
                          ConfigWarning, stacklevel=3)
    return out


def _block_of(blocks: Sequence[tuple[str, Any]], name: str) -> Any:
    return next((b for p, b in blocks if name.startswith(p + "/")), None)


def oneshot(src: str | os.PathLike[str], out: str | os.PathLike[str], recipe: Any, data: Any, *,
            num_samples: int = 128, seq_len: int = 512, batch_size: int = 8, forward_dtype: str = "model",
            progress: Any = True) -> dict[str, Any]:
    """Compress the keras-hub preset ``src`` (``config.json`` + ``model.weights.h5``, as ``save_to_preset``
    writes it) disk to disk with ``recipe`` (a YAML file, a YAML string or a list of ``{AlgorithmName:
    config_list}`` stages; the one-shot algorithms only) calibrated on ``data`` (a text file or folder, tokenized
    with the preset's own tokenizer; a ``.npy`` integer array ``[sequences, length]``; or such an array),
    ``num_samples`` sequences of ``seq_len`` tokens, and write the preset folder ``out`` that keras-hub loads
    without compressor (quantizers: Keras's own int4 / int8 / GPTQ / AWQ layers; pruners: float weights with
    zeros). One decoder block is in memory at a time; a killed run continues where it stopped when called
    again. Returns a summary (sizes in and out, the per-layer report rows, seconds)."""
    t0 = time.perf_counter()
    what = "oneshot"
    src, out = check_folders(src, out, "preset", what)
    stages = load_recipe(recipe, "tf", what="--recipe")
    _check_keras_layouts(stages)
    preset = HubPreset(src)
    vocab = preset.config["config"].get("vocabulary_size")
    tokens = _tokens(data, src, num_samples, seq_len, int(vocab) if isinstance(vocab, int) else None)
    check_disk_space(out, preset.nbytes, tokens.size, int(preset.config["config"].get("hidden_dim", 0) or 0), what)
    float64 = forward_in_float64(forward_dtype, what, not tf.config.list_logical_devices("GPU"))
    options = {"forward_dtype": forward_dtype, "batch_size": batch_size}
    work = out + ".partial"

    model = preset.skeleton()
    layers = [layer for layer in model._flatten_layers(include_self=False, recursive=True)]
    at = record_saveables(model, watch=layers).at  # where Keras saves each layer (before any wrapper is installed)
    compressors = _compressors(model, stages)
    backends = [KerasOneShotBackend(c, c._blocks, float64) for c in compressors]
    blocks = backends[0].blocks()
    for be in backends[1:]:
        if [id(b) for _, b in be.blocks()] != [id(b) for _, b in blocks]:
            raise ModelError(f"{what}: the recipe's stages find different decoder blocks ({[p for p, _ in blocks][:3]} "
                             f"vs {[p for p, _ in be.blocks()][:3]}); give every stage layers of the same blocks")
    wrappers: dict[int, list[Any]] = {id(b): [] for _, b in blocks}
    for c in compressors:
        for w in c.modules_wrapper:
            _drop_state(w)  # made for every layer at wrapping time; each block's are made again when it is read
            b = _block_of(blocks, w.name)
            if b is not None:
                wrappers[id(b)].append(w)
    _check_conversions(stages, compressors, wrappers[id(blocks[0][1])] if blocks else [])
    paths = {id(b): at.get(id(b)) for _, b in blocks}
    if not blocks or any(p is None for p in paths.values()):
        raise ModelError(f"{what}: no decoder blocks found among the layers the weights file holds")
    stage_pairs = [(be, c.method) for be, c in zip(backends, compressors)]
    batches = _batches(model, tokens, batch_size)
    check_stages(stage_pairs, batches)  # before the run folder is made
    key = _fingerprint(stages, preset, tokens, options)

    with preset.reader() as store:  # the layers outside the blocks: read once, kept
        preset.load(model, "", skip=[b for _, b in blocks], store=store)
    store = RunStore(os.path.join(work, "state"), key, len(blocks))
    io = _PresetIO(preset, [b for _, b in blocks], paths, wrappers, backends)
    with remapper_off():
        rows = run_streamed(stage_pairs, io, batches, store, progress, samples=len(tokens))
    for c in compressors:
        c.calibrated = True
    _write(preset, model, blocks, paths, store, os.path.join(work, "preset"))
    os.replace(os.path.join(work, "preset"), out)
    shutil.rmtree(work, ignore_errors=True)
    size_out = sum(os.path.getsize(os.path.join(out, f)) for f in (WEIGHTS_FILE, TASK_WEIGHTS_FILE)
                   if os.path.isfile(os.path.join(out, f)))
    return {"blocks": len(blocks), "bytes_in": preset.nbytes, "bytes_out": size_out, "rows": rows,
            "dense_notes": [], "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------------- output
def _write(preset: HubPreset, model: Any, blocks: Sequence[tuple[str, Any]], paths: dict[int, str],
           store: RunStore, folder: str) -> None:
    """The output preset in ``folder``: the weights file (the layers outside the blocks as Keras saves them,
    then each block's groups copied from its block file in the order Keras wrote them), ``config.json`` with
    the quantized layers' dtype policies, ``task.json`` with that backbone, the preset's other files."""
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    weights = os.path.join(folder, WEIGHTS_FILE)
    writer = _OutputWriter(weights, preset.group_names())
    policies: dict[str, Any] = {}
    try:
        saving_lib._save_state(model, weights_store=writer, assets_store=None, inner_path="",
                               visited_saveables={id(b) for _, b in blocks})
        for i in range(len(blocks)):
            reader = saving_lib.H5IOStore(store.block_path(i), mode="r")
            try:
                order = json.loads(reader.h5_file.attrs[_ORDER_ATTR])
                policies.update(json.loads(reader.h5_file.attrs[_POLICY_ATTR]))
                for path, name, keys in order:
                    writer.make(path, {"name": name} if name is not None else None)
                    entry = reader.get(path)
                    for k in keys:
                        writer[k] = entry[k]
            finally:
                reader.close()
            release_freed_heap()
    finally:
        writer.close()
    _sync(weights)
    config = json.loads(json.dumps(preset.config))
    if policies:
        default = keras.dtype_policies.get(preset.config["config"].get("dtype") or preset.dtype)
        policy_map = keras.dtype_policies.DTypePolicyMap(
            default_policy=default, policy_map={p: keras.dtype_policies.deserialize(v) for p, v in policies.items()})
        config["config"]["dtype"] = keras.dtype_policies.serialize(policy_map)
    _write_json(os.path.join(folder, CONFIG_FILE), config)
    if preset.task is not None:
        task = json.loads(json.dumps(preset.task))
        if isinstance(task.get("config"), dict) and isinstance(task["config"].get("backbone"), dict):
            task["config"]["backbone"] = config
        _write_json(os.path.join(folder, TASK_FILE), task)
    skip = {CONFIG_FILE, TASK_FILE, WEIGHTS_FILE, SHARDED_WEIGHTS_FILE}
    if preset.sharded:
        skip.update(os.path.basename(p) for p in preset.files)
    for name in sorted(os.listdir(preset.path)):
        p = os.path.join(preset.path, name)
        if name in skip:
            continue
        if os.path.isdir(p):
            shutil.copytree(p, os.path.join(folder, name), copy_function=shutil.copyfile)
        elif os.path.isfile(p):
            shutil.copyfile(p, os.path.join(folder, name))


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=4))
        f.flush()
        os.fsync(f.fileno())
