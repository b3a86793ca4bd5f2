"""A keras-hub preset directory read one layer at a time, for compressing presets larger than memory
(:mod:`compressor.tf.hub_oneshot`): the backbone is built from ``config.json`` without weights, and a decoder
block's weights are read from ``model.weights.h5`` (h5py, one dataset per variable) when its turn comes and
released after it.

A preset, as ``model.save_to_preset(dir)`` / ``backbone.save_to_preset(dir)`` writes it: ``config.json`` (the
backbone, a serialized Keras object with ``registered_name``), ``metadata.json`` (``keras_version``, ...),
``model.weights.h5`` (or ``model.weights.json`` and its shards, for presets over ``max_shard_size``), and for a
task ``task.json`` (and ``task.weights.h5`` when the task has weights of its own), ``preprocessor.json``,
``tokenizer.json`` and ``assets/``.

How Keras lays out the weights file (``saving_lib._save_state``; read here through Keras's own traversal, so
whatever a layer saves is found where Keras put it): one group per saveable object, named by the attribute path
from the model (a Functional model's ``layers`` list first, each list element by its snake-cased class name
made unique, ``layers/llama_transformer_decoder_1/_self_attention_layer/_query_dense``), its variables in a
``vars`` sub-group as datasets ``'0'``, ``'1'``, ... in the order of the layer's ``save_own_variables`` (a float
``Dense``: kernel, bias; Keras's int4 ``Dense``: packed kernel, bias, scale, ...), the ``vars`` group carrying
the object's ``name`` as an attribute; bfloat16 datasets carry ``dtype='bfloat16'``.

Without weights: the backbone is deserialized inside ``keras.StatelessScope(initialize_variables=False)``,
where Keras creates every variable uninitialized (its shape and dtype, no value: the backing ``tf.Variable`` is
made later). :meth:`HubPreset.load` gives a layer's variables their values from the file; :meth:`HubPreset.release`
drops them again (the Keras variable keeps its shape and dtype, its ``tf.Variable`` is gone).

:class:`HubPreset` checks the whole preset before any weight is read: ``config.json`` (a keras-hub backbone
Keras can build), the weights file(s) (readable HDF5; a sharded preset's map and shards), and, when the
skeleton is built, every variable the model saves against the file's datasets (present, same shape). Every
problem is a :class:`~compressor.core.compressed_tensors.CheckpointError` (a ``ModelError``) naming the file
and the variable.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import keras
import numpy as np
from keras.src.saving import saving_lib

from ..core.compressed_tensors import CheckpointError

__all__ = ["HubPreset", "is_hub_preset", "WEIGHTS_FILE", "SHARDED_WEIGHTS_FILE", "TASK_WEIGHTS_FILE"]

CONFIG_FILE = "config.json"
METADATA_FILE = "metadata.json"
TASK_FILE = "task.json"
WEIGHTS_FILE = "model.weights.h5"
SHARDED_WEIGHTS_FILE = "model.weights.json"
TASK_WEIGHTS_FILE = "task.weights.h5"


def is_hub_preset(path: str | os.PathLike[str]) -> bool:
    """Whether the folder ``path`` looks like a keras-hub preset: a ``config.json`` naming a registered Keras
    object (``registered_name``), or a ``metadata.json`` with ``keras_version``."""
    path = os.fspath(path)
    for name, key in ((CONFIG_FILE, "registered_name"), (METADATA_FILE, "keras_version")):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and key in data:
            return True
    return False


def _few(names: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return f"{shown} and {len(names) - n} more" if len(names) > n else shown


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path!r}: not a readable {what} JSON file ({e})") from None


class _Recorder(saving_lib.H5IOStore):
    """A weights store that writes nothing and reads no value: Keras's ``_save_state`` run with it lists, in
    Keras's order, every group it would write (``entries``: ``[path, name, {key: value}]``, the values as the
    layers hand them over, Keras variables themselves for plain layers) and which object it wrote at which
    path (``at``: ``{id(object): path}`` for the objects in ``watch``)."""

    def __init__(self, watch: Any = ()) -> None:  # noqa: D107 - no file
        self.mode = "w"
        self.entries: list[list[Any]] = []
        self._current: list[Any] | None = None
        self.watch = {id(o): o for o in watch}
        self.at: dict[int, str] = {}

    def __bool__(self) -> bool:
        return True

    def make(self, path: str, metadata: dict[str, Any] | None = None) -> _Recorder:
        self._current = [path, (metadata or {}).get("name"), {}]
        self.entries.append(self._current)
        return self

    def keys(self) -> Any:
        return self._current[2].keys() if self._current else {}.keys()

    def __len__(self) -> int:
        return len(self._current[2]) if self._current else 0

    def __contains__(self, item: Any) -> bool:
        return bool(self._current) and item in self._current[2]

    def __getitem__(self, key: str) -> Any:
        return self._current[2][key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._current[2][key] = value

    def close(self) -> None:
        pass


def record_saveables(model: Any, watch: Any = (), inner_path: str = "", skip: Any = ()) -> _Recorder:
    """What Keras's weight saving of ``model`` writes (see :class:`_Recorder`), without reading a value;
    ``skip``: objects (and everything under them) left out. Each object of ``watch`` gets a ``save_own_variables``
    on the instance for the walk, noting the path Keras gives it."""
    rec = _Recorder(watch)
    patched = []
    try:
        for obj in rec.watch.values():
            had = "save_own_variables" in vars(obj)
            old = obj.save_own_variables

            def noting(store: Any, obj: Any = obj, old: Any = old) -> None:
                rec.at[id(obj)] = store._current[0]
                old(store)
            object.__setattr__(obj, "save_own_variables", noting)
            patched.append((obj, had, old))
        saving_lib._save_state(model, weights_store=rec, assets_store=None, inner_path=inner_path,
                               visited_saveables={id(o) for o in skip})
    finally:
        for obj, had, old in patched:
            if had:
                object.__setattr__(obj, "save_own_variables", old)
            else:
                object.__delattr__(obj, "save_own_variables")
    return rec


@contextmanager
def without_weights() -> Iterator[None]:
    """Variables created inside are left uninitialized (shape and dtype, no value), and are not initialized
    later by another scope's exit (they are taken off Keras's list of variables awaiting initialization)."""
    from keras.src.backend.common import global_state

    key = "uninitialized_variables"
    before = list(global_state.get_global_attribute(key, []) or [])
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        global_state.set_global_attribute(key, before)


class HubPreset:
    """A keras-hub preset folder, checked up front and read one layer at a time.

    Attributes: ``path``, ``config`` (``config.json``), ``metadata`` (``metadata.json`` or ``{}``), ``task``
    (``task.json`` or None), ``weights`` (the weights file: ``model.weights.h5`` or ``model.weights.json``),
    ``sharded``, ``files`` (the HDF5 files: the single one, or the shards), ``datasets`` (``{'<group>/vars/<key>': (file, shape, dtype name)}`` of every weights file),
    ``nbytes`` (bytes of those datasets), ``dtype`` (the backbone's dtype policy name).
    """

    def __init__(self, src_dir: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(os.fspath(src_dir))
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path!r} is not a folder (a keras-hub preset is a folder holding "
                                  f"config.json and {WEIGHTS_FILE})")
        cfg_path = os.path.join(self.path, CONFIG_FILE)
        if not os.path.isfile(cfg_path):
            raise CheckpointError(f"{self.path!r}: no {CONFIG_FILE} (a keras-hub preset has one)")
        self.config = _read_json(cfg_path, "config")
        if not isinstance(self.config, dict) or not isinstance(self.config.get("config"), dict) or \
                "registered_name" not in self.config:
            raise CheckpointError(f"{cfg_path!r}: not a keras-hub backbone config (a serialized Keras object with "
                                  f"'registered_name' and 'config', as save_to_preset writes it)")
        meta_path = os.path.join(self.path, METADATA_FILE)
        self.metadata = _read_json(meta_path, "metadata") if os.path.isfile(meta_path) else {}
        task_path = os.path.join(self.path, TASK_FILE)
        self.task = _read_json(task_path, "task") if os.path.isfile(task_path) else None
        self.weights, self.sharded, self.files = self._weight_files()
        self.datasets = self._datasets(self.files)
        if not self.datasets:
            raise CheckpointError(f"{self.weights!r}: the weights file holds no variable")
        self.nbytes = sum(math.prod(shape) * np.dtype(_np_dtype(dt)).itemsize
                          for _, shape, dt in self.datasets.values())
        dtype = self.config["config"].get("dtype")
        self.dtype = (dtype.get("config", {}).get("name") if isinstance(dtype, dict) else dtype) or \
            keras.config.dtype_policy().name
        self._entries: dict[str, list[tuple[str, ...]]] = {}

    def __repr__(self) -> str:
        return (f"HubPreset({self.path!r}: {self.config.get('class_name')}, {len(self.datasets)} variables, "
                f"{self.dtype}, {self.nbytes:,} bytes)")

    # ------------------------------------------------------------------------------------------- checks
    def _weight_files(self) -> tuple[str, bool, list[str]]:
        single = os.path.join(self.path, WEIGHTS_FILE)
        if os.path.isfile(single):
            return single, False, [single]
        index = os.path.join(self.path, SHARDED_WEIGHTS_FILE)
        if not os.path.isfile(index):
            raise CheckpointError(f"{self.path!r}: neither {WEIGHTS_FILE} nor {SHARDED_WEIGHTS_FILE} (the preset's "
                                  f"weights; save_to_preset writes one of them)")
        data = _read_json(index, "sharded weights map")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index!r}: corrupted map (no weight_map object, or an empty one)")
        names: set[str] = set()
        for v in weight_map.values():
            names.update(v if isinstance(v, list) else [v])
        bad = sorted(str(n)[:80] for n in names if not (isinstance(n, str) and os.path.basename(n) == n
                                                          and n.endswith(".h5")))
        if bad:
            raise CheckpointError(f"{index!r}: the map names files that are not .h5 files inside the preset folder: "
                                  f"{_few(bad)}")
        files = [os.path.join(self.path, n) for n in sorted(names)]
        for f in files:
            if not os.path.isfile(f):
                raise CheckpointError(f"{index!r}: shard {os.path.basename(f)!r} is missing from {self.path!r}")
        return index, True, files

    def _datasets(self, files: list[str]) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """Every dataset of the weights files (their headers only), refusing what Keras's loader refuses too
        (links, external or virtual datasets) and a variable held by two shards."""
        import h5py

        out: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for path in files:
            try:
                f = h5py.File(path, "r")
            except OSError as e:
                raise CheckpointError(f"{path!r}: not a readable HDF5 weights file (truncated or corrupted?): {e}") \
                    from None
            with f:
                found: list[tuple[str, Any]] = []

                def visit(name: str, link: Any, path: str = path, found: list[tuple[str, Any]] = found) -> None:
                    if isinstance(link, (h5py.SoftLink, h5py.ExternalLink)):
                        raise CheckpointError(f"{path!r}: {name!r} is a link; weights files hold datasets only")
                    found.append((name, link))
                f.visititems_links(visit)
                for name, _ in found:
                    obj = f.get(name)
                    if not isinstance(obj, h5py.Dataset):
                        continue
                    if obj.external or obj.is_virtual:
                        raise CheckpointError(f"{path!r}: dataset {name!r} is external or virtual; not read")
                    if name in out:
                        raise CheckpointError(f"{self.path!r}: variable {name!r} is in two shards: "
                                              f"{os.path.basename(out[name][0])!r} and {os.path.basename(path)!r}")
                    dt = obj.attrs.get("dtype", None)
                    dt = dt.decode() if isinstance(dt, bytes) else dt
                    out[name] = (path, tuple(int(d) for d in obj.shape), dt if dt == "bfloat16" else str(obj.dtype))
        return out

    def group_names(self) -> dict[str, str]:
        """``{group path: name}`` of every ``vars`` group of the weights file(s): the ``name`` attribute Keras
        wrote (the layer's name; an automatic one, e.g. ``'dropout_3'``, depends on the layers a process made
        before, so the output takes the source's)."""
        import h5py

        out: dict[str, str] = {}
        for path in self.files:
            with h5py.File(path, "r") as f:
                def visit(name: str, obj: Any) -> None:
                    if isinstance(obj, h5py.Group) and (name == "vars" or name.endswith("/vars")) and \
                            "name" in obj.attrs:
                        value = obj.attrs["name"]
                        out.setdefault(name[:-len("vars")].rstrip("/"),
                                       value.decode() if isinstance(value, bytes) else str(value))
                f.visititems(visit)
        return out

    # ------------------------------------------------------------------------------------------ skeleton
    def skeleton(self) -> Any:
        """The backbone of ``config.json``, built without weights (every variable uninitialized, see the module
        docstring), checked against the weights file: every variable it saves is there with its shape, and
        the file holds nothing else."""
        try:
            with without_weights():
                model = keras.saving.deserialize_keras_object(self.config)
        except Exception as e:  # noqa: BLE001 - deserialization raises anything the class's __init__ raises
            raise CheckpointError(f"{os.path.join(self.path, CONFIG_FILE)!r}: Keras {keras.__version__} cannot "
                                  f"build the backbone it describes: {type(e).__name__}: {str(e)[:400]}") from None
        if not isinstance(model, keras.Model):
            raise CheckpointError(f"{os.path.join(self.path, CONFIG_FILE)!r} describes a "
                                  f"{type(model).__name__}, not a model")
        self._match(model)
        return model

    def _match(self, model: Any) -> None:
        rec = record_saveables(model)
        want: dict[str, tuple[int, ...]] = {}
        for path, _, values in rec.entries:
            for key, value in values.items():
                want[_dataset_name(path, key)] = tuple(int(d) for d in value.shape)
        missing = [n for n in want if n not in self.datasets]
        extra = [n for n in self.datasets if n not in want]
        if missing or extra:
            parts = [f"{self.weights!r} does not match the {type(model).__name__} its {CONFIG_FILE} describes"]
            if extra:
                parts.append(f"variables the model does not have: {_few(extra)}")
            if missing:
                parts.append(f"model variables absent from the file: {_few(missing)}")
            raise CheckpointError("; ".join(parts))
        for name, shape in want.items():
            path, have, _ = self.datasets[name]
            if have != shape:
                raise CheckpointError(f"{path!r}: variable {name!r} has shape {list(have)}, the model built from "
                                      f"{CONFIG_FILE} expects {list(shape)}")

    # ------------------------------------------------------------------------------------- load / release
    @contextmanager
    def reader(self) -> Iterator[Any]:
        """Keras's own store over the weights file(s), open for reading (values are read per dataset)."""
        store = saving_lib.ShardedH5IOStore(self.weights, mode="r") if self.sharded else \
            saving_lib.H5IOStore(self.weights, mode="r")
        try:
            yield store
        finally:
            store.close()

    def load(self, layer: Any, inner_path: str, skip: Any = (), store: Any = None) -> None:
        """Give every variable of ``layer`` (saved by Keras at ``inner_path`` of the file, e.g.
        ``'layers/llama_transformer_decoder_3'``; ``''``: the model itself) its value from the weights file,
        through Keras's own loader (each layer's ``load_own_variables``, one dataset read at a time). ``skip``:
        objects left alone (their variables stay as they are)."""
        skipped = {id(v) for o in skip for v in getattr(o, "variables", ())}
        for v in _variables(layer):
            if v._value is None and id(v) not in skipped:
                v._initialize(np.zeros(v.shape, _np_dtype(v.dtype)))
        if store is None:
            with self.reader() as s:
                self.load(layer, inner_path, skip, s)
            return
        errors: dict[int, Any] = {}
        failed: set[int] = set()
        saving_lib._load_state(layer, weights_store=store, assets_store=None, inner_path=inner_path,
                               visited_saveables={id(o) for o in skip}, failed_saveables=failed, error_msgs=errors)
        if failed:
            obj, err = next(iter(errors.values()))
            raise CheckpointError(f"{self.weights!r}: {getattr(obj, 'name', obj)!r} (at {inner_path or '/'!r}) does "
                                  f"not load: {str(err)[:400]}")

    @staticmethod
    def release(layer: Any) -> None:
        """Drop the values of ``layer``'s variables (each keeps its shape and dtype; :meth:`load` gives them
        back)."""
        for v in _variables(layer):
            v._value = None

    @staticmethod
    def loaded(layer: Any) -> int:
        """How many of ``layer``'s variables hold a value now."""
        return sum(v._value is not None for v in _variables(layer))


def _variables(layer: Any) -> list[Any]:
    seen: set[int] = set()
    out = []
    for v in layer.variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _dataset_name(path: str, key: str) -> str:
    return f"{path}/vars/{key}" if path else f"vars/{key}"


def _np_dtype(name: Any) -> Any:
    name = getattr(name, "name", name)
    if str(name) == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(str(name))
