"""A Hugging Face checkpoint read one submodule at a time, for compressing checkpoints larger than memory
(:mod:`compressor.torch.hf_oneshot`): the model is built without weights, and a decoder block's weights are read from the safetensors
files (memory-mapped) when its turn comes and released after it.

:class:`HfCheckpoint` checks the whole folder before any weight is read: ``config.json``, the single
``model.safetensors`` or the shards named by ``model.safetensors.index.json`` (their headers only: a
truncated shard, a tensor in two shards, an index that disagrees with its shards, a dtype other than F32 /
BF16 / F16), then, when the skeleton is built, the checkpoint's names and shapes against the model's
``state_dict``. Every problem is a :class:`~compressor.core.compressed_tensors.CheckpointError` (a
``ModelError``) naming the file and the tensor.

A model-family module: imported by the streaming command only (it imports transformers, accelerate and
safetensors).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..core.compressed_tensors import CheckpointError, _read_json, read_safetensors_header
from ..core.errors import ModelError

__all__ = ["HfCheckpoint", "SINGLE_FILE", "INDEX_FILE", "FLOAT32_SHARE"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: the safetensors dtypes taken, and the torch dtype of each
_DTYPES: dict[str, torch.dtype] = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
#: a 16-bit checkpoint may hold float32 tensors (norms, biases, routers kept wide) up to this share of its
#: elements; they are cast to the checkpoint's dtype when loaded, as ``from_pretrained(dtype=...)`` does
FLOAT32_SHARE = 0.05
#: names a checkpoint may hold that the model no longer has, besides the model class's own
#: ``_keys_to_ignore_on_load_unexpected``: ``{buffer the model has: pattern skipped}``, what ``from_pretrained``
#: skips too (per-layer rotary ``inv_freq`` and persistent ``position_ids`` of older transformers)
_LEGACY_UNEXPECTED = {"rotary_emb.inv_freq": r"rotary_emb\.inv_freq", "position_ids": r"(^|\.)position_ids$"}


def _few(names: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return f"{shown} and {len(names) - n} more" if len(names) > n else shown


class HfCheckpoint:
    """A Hugging Face causal-LM checkpoint folder, checked up front and read one submodule at a time.

    Attributes: ``path`` (the folder), ``config`` (its ``PretrainedConfig``, read offline), ``files`` (the
    safetensors files, full paths), ``tensors`` (``{name: (file, safetensors dtype, shape)}`` from the
    headers), ``dtype`` (the weights' torch dtype), ``nbytes`` (bytes of tensor data in all files).
    """

    def __init__(self, src_dir: str | os.PathLike) -> None:
        self.path = os.path.abspath(os.fspath(src_dir))
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path!r} is not a folder (a Hugging Face checkpoint is a folder holding "
                                  f"config.json and safetensors files)")
        cfg_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_path):
            raise CheckpointError(f"{self.path!r}: no config.json (a Hugging Face checkpoint has one)")
        self.config = self._config(cfg_path)
        self.files, index = self._files()
        self.tensors: dict[str, tuple[str, str, tuple[int, ...]]] = {}
        self.nbytes = 0
        for path in self.files:
            header, _ = read_safetensors_header(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _DTYPES:
                    raise CheckpointError(f"{path!r}: tensor {name!r} has dtype {info['dtype']}; this reader takes "
                                          f"F32, BF16 and F16 checkpoints")
                if name in self.tensors:
                    raise CheckpointError(f"{self.path!r}: tensor {name!r} is in two shards: "
                                          f"{self.tensors[name][0]!r} and {path!r}")
                self.tensors[name] = (path, info["dtype"], tuple(int(d) for d in info["shape"]))
                a, b = info["data_offsets"]
                self.nbytes += b - a
        if index is not None:
            self._check_index(*index)
        if not self.tensors:
            raise CheckpointError(f"{self.path!r}: the safetensors files hold no tensor")
        self.dtype = self._dtype()
        self._source: dict[str, str] | None = None  # model key -> file key, set by skeleton()
        self._stacked: dict[str, list[Any]] = {}  # fused model key -> its per-expert pieces in the files
        self._aliases: dict[str, tuple[str, ...]] = {}  # model key -> every model key sharing its tensor
        self._tied = False  # the skeleton has tensors under several names
        self._root: weakref.ref[nn.Module] | None = None
        self.unused: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return (f"HfCheckpoint({self.path!r}: {type(self.config).__name__}, {len(self.tensors)} tensors in "
                f"{len(self.files)} file(s), {self.dtype}, {self.nbytes:,} bytes)")

    # ------------------------------------------------------------------------------------------- checks
    def _files(self) -> tuple[list[str], tuple[str, dict[str, str]] | None]:
        """The safetensors files to read, and ``(index path, weight_map)`` when the checkpoint is sharded.
        ``model.safetensors`` wins over an index, as in ``from_pretrained``."""
        single = os.path.join(self.path, SINGLE_FILE)
        if os.path.lexists(single):  # not a regular file (a FIFO, a device, a folder): refused as its header is read
            return [single], None
        index = os.path.join(self.path, INDEX_FILE)
        if not os.path.isfile(index):
            raise CheckpointError(f"{self.path!r}: neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
                                  f"checkpoints are read)")
        weight_map = _read_json(index, "index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index!r}: corrupted index (no weight_map object, or an empty one)")
        bad = sorted({str(v)[:80] for v in weight_map.values()
                      if not (isinstance(v, str) and v.endswith(".safetensors") and os.path.basename(v) == v)})
        if bad:
            raise CheckpointError(f"{index!r}: the index names files that are not .safetensors files inside the "
                                  f"checkpoint folder: {_few(bad)}")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not os.path.lexists(os.path.join(self.path, shard)):
                first = next(k for k, v in weight_map.items() if v == shard)
                raise CheckpointError(f"{index!r}: shard {shard!r} (holding {first!r} and more) is missing from "
                                      f"{self.path!r}")
        return [os.path.join(self.path, s) for s in shards], (index, weight_map)

    def _check_index(self, index: str, weight_map: dict[str, str]) -> None:
        """The index and the shards' headers name the same tensors in the same files."""
        for name, (path, _, _) in self.tensors.items():
            listed = weight_map.get(name)
            if listed is None:
                raise CheckpointError(f"{path!r}: tensor {name!r} is not in the index {index!r}")
            if listed != os.path.basename(path):
                raise CheckpointError(f"{index!r}: tensor {name!r} is listed in {listed!r} but is in {path!r}")
        for name, shard in weight_map.items():
            if name not in self.tensors:
                raise CheckpointError(f"{index!r}: tensor {name!r} is listed in {shard!r}, which does not hold it")

    def _dtype(self) -> torch.dtype:
        """The weights' dtype: the one float dtype of the files; a 16-bit checkpoint may keep a few float32
        tensors (at most FLOAT32_SHARE of the elements), which load as the 16-bit dtype."""
        count: dict[str, int] = {}
        example: dict[str, str] = {}
        for name, (_, dt, shape) in self.tensors.items():
            count[dt] = count.get(dt, 0) + math.prod(shape)
            example.setdefault(dt, name)
        narrow = sorted(d for d in count if d != "F32")
        if len(narrow) > 1:
            raise CheckpointError(f"{self.path!r}: the checkpoint mixes BF16 and F16 tensors (e.g. "
                                  f"{example['BF16']!r} and {example['F16']!r}); one dtype is needed")
        if not narrow:
            return torch.float32
        wide, total = count.get("F32", 0), sum(count.values())
        if wide > FLOAT32_SHARE * total:
            names = [n for n, (_, dt, _) in self.tensors.items() if dt == "F32"]
            raise CheckpointError(
                f"{self.path!r}: the checkpoint mixes {narrow[0]} and F32 tensors, and the F32 ones hold "
                f"{wide / total:.0%} of the elements (at most {FLOAT32_SHARE:.0%} are taken and loaded as "
                f"{narrow[0]}): {_few(names)}")
        return _DTYPES[narrow[0]]

    def _config(self, cfg_path: str) -> Any:
        import transformers

        try:
            return transformers.AutoConfig.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{cfg_path!r}: transformers {transformers.__version__} cannot read it: "
                                  f"{str(e)[:400]}") from None

    # ------------------------------------------------------------------------------------------ skeleton
    def skeleton(self) -> nn.Module:
        """The causal-LM model of ``config`` in eval mode, its parameters on the meta device (no memory), its
        buffers real CPU tensors (rotary ``inv_freq`` as the model computes it), tied weights tied; checked
        against the checkpoint's names and shapes before it is returned.

        Built with ``accelerate.init_empty_weights(include_buffers=False)``, which keeps every buffer the
        constructor computes; its parameter hook re-creates a parameter registered twice, so the ties are
        made again afterwards (``tie_weights``)."""
        import transformers
        from accelerate import init_empty_weights

        try:
            with init_empty_weights(include_buffers=False):
                model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"{self.path!r}: transformers {transformers.__version__} builds no causal language "
                             f"model from this config.json: {str(e)[:400]}") from None
        model.tie_weights()
        model.eval()
        self._match(model)
        self._root = weakref.ref(model)
        return model

    def _match(self, model: nn.Module) -> None:
        """Set the model-key -> file-key map, or fail naming the tensors the model and the files disagree on."""
        state = model.state_dict(keep_vars=True)
        groups: dict[int, list[str]] = {}
        for key, value in state.items():
            groups.setdefault(id(value), []).append(key)
        source: dict[str, str] = {}
        aliases: dict[str, tuple[str, ...]] = {}
        missing: list[str] = []
        stacked: dict[str, list[Any]] = {}
        used: set[str] = set()  # file keys read under another name (renamed, per-expert pieces)
        layout: tuple[dict[str, list[Any]], dict[str, str]] | None = None
        for keys in groups.values():
            present = [k for k in keys if k in self.tensors]
            if not present:
                # transformers' on-disk layout (what save_pretrained writes): the fused routed experts as
                # per-expert tensors, some modules renamed (Mixtral's block_sparse_moe)
                if layout is None:
                    from .sequential.expert_banks import checkpoint_layout

                    layout = checkpoint_layout(model, renames=True)
                pieces = layout[0].get(keys[0])
                renamed = [layout[1][k] for k in keys if layout[1].get(k) in self.tensors]
                if renamed:
                    present = renamed[:1]
                    used.add(renamed[0])
                elif pieces and all(f"{p.name}.weight" in self.tensors for p in pieces):
                    for key in keys:
                        stacked[key] = pieces
                        aliases[key] = tuple(keys)
                    used.update(f"{p.name}.weight" for p in pieces)
                    continue
                else:
                    missing.append(keys[0] if len(keys) == 1 else " = ".join(keys))
                    continue
            for key in keys:
                source[key] = present[0]
                aliases[key] = tuple(keys)
        buffers = [name for name, _ in model.named_buffers()]
        patterns = [*(type(model)._keys_to_ignore_on_load_unexpected or ()),
                    *(p for end, p in _LEGACY_UNEXPECTED.items() if any(b.endswith(end) for b in buffers))]
        extra, unused = [], []
        for name in self.tensors:
            if name in state or name in used:
                continue
            (unused if any(re.search(p, name) for p in patterns) else extra).append(name)
        if extra or missing:
            from transformers.conversion_mapping import get_checkpoint_conversion_mapping

            model_type = getattr(self.config, "model_type", "?")
            parts = [f"{self.path!r} does not match the {type(model).__name__} its config.json describes"]
            if extra:
                parts.append(f"tensors the model does not have: {_few(extra)}")
            if missing:
                parts.append(f"model tensors absent from the files: {_few(missing)}")
            msg = "; ".join(parts)
            if get_checkpoint_conversion_mapping(model_type):
                msg += (f" (transformers renames or fuses {model_type!r} checkpoints' tensors while loading them; "
                        f"this reader follows its renames and stacks routed experts' per-expert weights into the "
                        f"fused parameters, and found neither the model's names nor transformers' for these)")
            raise CheckpointError(msg)
        for key, name in source.items():
            want, (path, _, have) = tuple(state[key].shape), self.tensors[name]
            if have != want:
                raise CheckpointError(f"{path!r}: tensor {name!r} has shape {list(have)}, the model built from "
                                      f"config.json expects {list(want)}")
        for key, pieces in stacked.items():
            for p in pieces:
                name = f"{p.name}.weight"
                want, (path, _, have) = (p.n_rows, p.shape[2]), self.tensors[name]
                if have != want:
                    raise CheckpointError(f"{path!r}: tensor {name!r} (expert {p.expert} of the model's {key!r}) has "
                                          f"shape {list(have)}, the model built from config.json expects {list(want)}")
        self._source, self._aliases, self.unused = source, aliases, tuple(unused)
        self._stacked = stacked
        self._tied = any(len(keys) > 1 for keys in groups.values())

    # ------------------------------------------------------------------------------------- load / release
    def _slots(self, module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module, str, bool]]:
        """``(model key, owner module, attribute, is parameter)`` of every parameter and persistent buffer of
        ``module`` (a tensor shared by two owners is listed under each)."""
        for path, owner in module.named_modules(remove_duplicate=False):
            head = f"{prefix}{path}." if path else prefix
            for attr, p in owner._parameters.items():
                if p is not None:
                    yield head + attr, owner, attr, True
            for attr, b in owner._buffers.items():
                if b is not None and attr not in owner._non_persistent_buffers_set:
                    yield head + attr, owner, attr, False

    def _file_key(self, key: str) -> str | None:
        if self._source is not None:
            return self._source.get(key)
        return key if key in self.tensors else None

    def holds(self, key: str) -> bool:
        """Whether :meth:`read` gives the model key or file name ``key`` (a tensor of the files, one renamed in
        them, or routed experts stacked from their per-expert tensors)."""
        return key in self.tensors or self._file_key(key) is not None or key in self._stacked

    def _read_stacked(self, key: str) -> torch.Tensor:
        """The fused routed-experts parameter ``key`` from its per-expert tensors (each read once)."""
        from safetensors import safe_open

        pieces = self._stacked[key]
        by_file: dict[str, list[Any]] = {}
        for p in pieces:
            by_file.setdefault(self.tensors[f"{p.name}.weight"][0], []).append(p)
        out: torch.Tensor | None = None
        for path, ps in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for p in ps:
                    value = f.get_tensor(f"{p.name}.weight")
                    if out is None:
                        out = torch.empty(p.shape, dtype=value.dtype)
                    rows = p.rows if isinstance(p.rows, slice) else torch.from_numpy(p.rows)
                    out[p.expert][rows] = value.to(out.dtype)
        assert out is not None
        return out

    def _replace(self, module: nn.Module, new: dict[int, torch.Tensor], tied: bool) -> None:
        """Put ``new[id(old)]`` in place of every ``old`` tensor of ``module`` (and of the whole skeleton when
        a replaced tensor is tied to names outside ``module``), so ties stay ties."""
        scopes = [module]
        root = self._root() if (tied and self._root is not None) else None
        if root is not None and root is not module:
            scopes.append(root)
        for scope in scopes:
            for owner in scope.modules():
                for table in (owner._parameters, owner._buffers):
                    for attr, value in table.items():
                        if value is not None and id(value) in new:
                            table[attr] = new[id(value)]

    def load(self, module: nn.Module, prefix: str) -> None:
        """Materialize every parameter and persistent buffer of ``module`` (whose state_dict keys are
        ``prefix`` + local name, e.g. ``'model.layers.3.'``) on the CPU, read from the safetensors files
        (memory-mapped, only this module's tensors, each file opened once) and cast to the skeleton's
        dtype. A parameter tied to one outside ``module`` (``lm_head`` / ``embed_tokens``) is loaded once,
        from the tensor the file holds, and replaced everywhere it is used."""
        plan: dict[str, list[tuple[str, torch.Tensor, bool]]] = {}  # file -> (file key, old tensor, is param)
        seen: set[int] = set()
        tied = False
        for key, owner, attr, is_param in self._slots(module, prefix):
            old = (owner._parameters if is_param else owner._buffers)[attr]
            if id(old) in seen:
                continue
            if key in self._stacked:
                seen.add(id(old))
                plan.setdefault("", []).append((key, old, is_param))
                continue
            name = self._file_key(key)
            if name is None:
                raise ModelError(f"{self.path!r}: {key!r} is not a tensor of the checkpoint (is {prefix!r} the "
                                 f"module's prefix in the model?)")
            seen.add(id(old))
            tied = tied or len(self._aliases.get(key, ())) > 1
            plan.setdefault(self.tensors[name][0], []).append((name, old, is_param))
        from safetensors import safe_open

        new: dict[int, torch.Tensor] = {}
        for path, items in plan.items():
            with safe_open(path, framework="pt", device="cpu") if path else contextlib.nullcontext() as f:
                for name, old, is_param in items:
                    value = f.get_tensor(name) if path else self._read_stacked(name)
                    if value.dtype != old.dtype and value.is_floating_point():
                        value = value.to(old.dtype)
                    new[id(old)] = nn.Parameter(value, requires_grad=old.requires_grad) if is_param else value
        self._replace(module, new, tied)

    def release(self, module: nn.Module) -> None:
        """Give back the memory of ``module``'s parameters and persistent buffers: each goes back to the meta
        device (a tied one everywhere it is used), ready for :meth:`load` again."""
        new: dict[int, torch.Tensor] = {}
        for _, owner, attr, is_param in self._slots(module, ""):
            old = (owner._parameters if is_param else owner._buffers)[attr]
            if id(old) in new or old.device.type == "meta":
                continue
            empty = torch.empty_like(old, device="meta")
            new[id(old)] = nn.Parameter(empty, requires_grad=old.requires_grad) if is_param else empty
        self._replace(module, new, self._tied)

    def read(self, name: str) -> torch.Tensor:
        """One tensor as stored in the files (its own dtype), memory-mapped and copied out; ``name`` is a
        file name or a model key (a tied ``lm_head.weight`` reads the embedding's tensor)."""
        if name not in self.tensors and name in self._stacked:
            return self._read_stacked(name)
        key = name if name in self.tensors else self._file_key(name)
        if key is None:
            raise CheckpointError(f"{self.path!r}: no tensor {name!r} in the checkpoint")
        from safetensors import safe_open

        with safe_open(self.tensors[key][0], framework="pt", device="cpu") as f:
            return f.get_tensor(key)
