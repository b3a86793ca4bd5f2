"""The ``compressor`` command line.

``compressor list`` (backends and algorithms, incl. plugins), ``compressor check CONFIG.yaml`` (validate a
config file, print it normalised), ``compressor report MODEL_FILE`` (per-layer sparsity / bits of an
exported model; ``--flops``: MACs and params dense vs. after speedup), ``compressor pack MODEL_FILE OUT`` /
``compressor unpack PACKED OUT`` (the compressed model file of :mod:`compressor.core.cmpk`),
``compressor oneshot SRC_DIR OUT_DIR --recipe R --data D`` (a language-model checkpoint compressed block by block,
disk to disk, resumable), ``compressor demo`` (the examples' demo). Exit codes: 0 ok, 2 bad input; every error is one readable line
on stderr. ``list`` and ``check`` without a backend algorithm import neither torch
nor tensorflow.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from ..core.errors import BackendNotAvailable, CompressedFileError, ConfigError, ModelError

BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``compressor: error: ...``) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(BAD_INPUT)


def _one_line(message: Any) -> str:
    return " ".join(str(message).split())


# ---------------------------------------------------------------------------------------------- list
def _cmd_list(args: argparse.Namespace) -> int:
    from ..core.registry import registry

    reg = registry()
    if getattr(args, "json", False):
        plugins = {f"{e.backend}:{e.name}": e.plugin for e in reg.entries()}
        print(json.dumps({"backends": {b: i.installed for b, i in sorted(reg.backends.items())},
                          "algorithms": reg.available(), "plugins": plugins}, indent=2))
        return 0
    from ..core.registry import BUILTIN_PLUGINS

    avail = reg.available()
    origin = {(e.backend, e.name): e.plugin for e in reg.entries()}
    for name, info in sorted(reg.backends.items()):
        state = "installed" if info.installed else f"not installed (pip install 'compressor[{name}]')"
        print(f"backend {name}: {info.description} [{state}]")
        for kind, names in avail.get(name, {}).items():
            shown = [n if origin.get((name, n)) in BUILTIN_PLUGINS else f"{n} (plugin {origin.get((name, n))})"
                     for n in names]
            print(f"  {kind}: {', '.join(shown) if shown else '(none)'}")
    return 0


# --------------------------------------------------------------------------------------------- check
def _algorithm_class(name: str, backend: str | None) -> type | None:
    """The class of algorithm ``name`` (a seed-004 name is translated) on ``backend``; without one, on the
    backend its seed-004 prefix names or else the first installed backend that has it. None (with a
    warning) when no installed backend provides it: the generic checks still run."""
    from ..core.algorithms import resolve_algorithm_name
    from ..core.registry import registry

    prefix_backend, modern = resolve_algorithm_name(name)
    reg = registry()
    if backend is not None:
        return reg.get(backend, modern)  # an explicit backend must be usable
    having = [b for b in sorted(reg.backends) if reg.has(b, modern)]
    if not having:
        import difflib

        names = reg.names()
        close = difflib.get_close_matches(modern, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"no algorithm {name!r}{hint}; available: {names}")
    installed = [b for b in having if reg.backends[b].installed]
    if not installed:
        warnings.warn(f"no installed backend provides {modern!r} (it needs one of {having}); "
                      f"only the keys common to all algorithms were checked", stacklevel=2)
        return None
    return reg.get(prefix_backend if prefix_backend in installed else installed[0], modern)


def _normalise_for(entries: Any, cls: type | None, what: str) -> list[dict[str, Any]]:
    from ..core.config import OPTIONAL_KEYS, normalize_config_list

    if cls is None:  # no algorithm known: every key some algorithm may use is accepted
        return normalize_config_list(entries, extra_keys=tuple(OPTIONAL_KEYS), what=what)
    out = normalize_config_list(entries, extra_keys=getattr(cls, "config_keys", ()),
                                required=getattr(cls, "required_keys", ()), what=what)
    validate = getattr(cls, "validate_config", None)
    if validate is not None:
        # cross-entry checks that need no model; an algorithm whose check needs its __init__ state is
        # checked fully when it is built on a model
        try:
            validate(object.__new__(cls), out)
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - not checkable without a model
            pass
    return out


def _cmd_check(args: argparse.Namespace) -> int:
    import yaml

    from ..core.algorithms import resolve_algorithm_name
    from ..core.config import load_configs

    sections = load_configs(args.config)
    if args.algorithm is not None and None not in sections:
        _, wanted = resolve_algorithm_name(args.algorithm)
        named = {s for s in sections if s is not None and resolve_algorithm_name(s)[1] == wanted}
        if named:
            sections = {s: sections[s] for s in sections if s in named}
        elif len(sections) > 1:
            raise ConfigError(f"config file {args.config!r} has no section for {args.algorithm!r}; "
                              f"sections: {sorted(sections)}")
    errors: list[str] = []
    result: dict[str | None, list[dict[str, Any]]] = {}
    for section, entries in sections.items():
        where = f"section {section!r}: " if section is not None else ""
        name = args.algorithm or section
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                cls = None
                if name is not None and (args.algorithm is not None or _is_algorithm(section)):
                    cls = _algorithm_class(name, args.backend)
                result[section] = _normalise_for(entries, cls, cls.__name__ if cls is not None else "config")
            except (ConfigError, BackendNotAvailable) as e:
                errors.append(f"{where}{e}")
        for w in caught:
            print(f"compressor: warning: {where}{_one_line(w.message)}", file=sys.stderr)
    for e in errors:
        print(f"compressor: error: {args.config}: {_one_line(e)}", file=sys.stderr)
    if errors:
        return BAD_INPUT
    data: Any = result[None] if None in result else {s: {"config": c} for s, c in result.items()}
    sys.stdout.write(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    return 0


def _is_algorithm(section: str | None) -> bool:
    """True when a YAML section is named after a registered algorithm (``tfAGPruner``, ``LevelPruner``)."""
    if section is None:
        return False
    from ..core.algorithms import resolve_algorithm_name
    from ..core.registry import registry

    return resolve_algorithm_name(section)[1] in registry().names()


# -------------------------------------------------------------------------------------------- report
def _is_checkpoint_dir(path: str) -> bool:
    import os

    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


_MAX_BYTES_HELP = ("the most bytes the weights may decode to (e.g. 40G; default: 32 MiB + 16x the files' size, or "
                   "COMPRESSOR_MAX_DECODED_BYTES): a file claiming more is refused before it is decoded")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(text: str) -> int:
    """``--max-bytes``: a number of bytes, optionally with K / M / G / T (binary multiples, ``iB`` / ``B`` allowed)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if m is None or float(m.group(1)) * _UNITS[m.group(2).upper()] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size in bytes, e.g. 500000000, 512M or 40G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _cmd_report(args: argparse.Namespace) -> int:
    from . import report

    if _is_checkpoint_dir(args.model):  # a compressed-tensors (Hugging Face) checkpoint folder
        from ..core.compressed_tensors import checkpoint_report, format_checkpoint_report

        rep = checkpoint_report(args.model, max_bytes=args.max_bytes)
        print(json.dumps(rep, indent=2) if args.json else format_checkpoint_report(rep))
        return 0

    weights, masks, quantized = report.read_weights_info(args.model)
    if args.masks is not None:
        masks = report.read_masks(args.masks)
    calibration = report.read_calibration(args.calibration) if args.calibration is not None else None
    rows = report.layer_stats(weights, masks, calibration, quantized)
    flops = None
    if args.flops or args.input_shape is not None or args.model_fn is not None:
        shape = report.parse_input_shape(args.input_shape) if args.input_shape is not None else None
        flops = report.file_flops(args.model, args.masks, shape, args.model_fn)
    sizes = report.file_sizes([args.model, *args.artifact]) if args.artifact else None
    if args.plot is not None:
        report.plot(rows, args.plot)
    if args.json:
        data: Any = report.as_dicts(rows)
        if flops is not None or sizes is not None:
            data = {"layers": data}
            if flops is not None:
                data["flops"] = flops
            if sizes is not None:
                data["files"] = sizes
        print(json.dumps(data, indent=2))
    else:
        print(report.format_table(rows))
        if flops is not None:
            from ..core.report import format_flops

            print(format_flops(flops))
        if sizes is not None:
            print(report.format_sizes(sizes))
        if args.plot is not None:
            print(f"plot written to {args.plot}")
    return 0


# --------------------------------------------------------------------------------------- pack / unpack
def _read_exported(path: str) -> tuple[dict[str, Any], str | None]:
    """``({name: numpy array}, backend)`` of an exported model file: a torch state_dict (``.pt``/``.pth``,
    loaded with ``weights_only=True``), a Keras ``.keras`` file (weights by layer path) or a ``.npz``."""
    import os

    from .report.files import _check_file, _read_npz
    from .report.torch_files import TORCH_SUFFIXES, _torch_load

    p = _check_file(path, "model file")
    suffix = os.path.splitext(p)[1].lower()
    if suffix in TORCH_SUFFIXES:
        state = _torch_load(p)
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise ModelError(f"{p!r} is not a state_dict (a dict of parameter names to tensors)")
        from ..torch.cmpk import state_dict_arrays

        try:
            return state_dict_arrays(state), "torch"
        except ValueError as e:
            raise ModelError(f"{p!r}: {e}") from None
    if suffix == ".keras":
        from .report import load_keras

        model = load_keras(p)
        from ..tf.cmpk import model_arrays

        return model_arrays(model), "tf"
    if suffix == ".npz":
        return _read_npz(p), None
    raise ConfigError(f"cannot pack {p!r}: allowed model files are .pt/.pth (torch state_dict), .keras, .npz")


def _cmd_pack(args: argparse.Namespace) -> int:
    import os

    from ..core.cmpk import CODECS, pack, packed_sizes

    arrays, backend = _read_exported(args.model)
    try:
        res = pack(arrays, args.output, codec=args.codec, backend=backend)
        sizes = packed_sizes(arrays, ("auto", *CODECS)) if args.compare else None
    except ValueError as e:
        raise ModelError(f"cannot pack {args.model!r}: {e}") from None
    dense = os.path.getsize(args.model)
    data = {"input": args.model, "input_bytes": dense, "output": args.output, "bytes": res.bytes,
            "ratio": round(dense / res.bytes, 2), "codec": args.codec,
            "tensors": [{k: (list(v) if isinstance(v, tuple) else v) for k, v in t.items()} for t in res.tensors]}
    if sizes is not None:
        data["sizes_by_codec"] = sizes
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"{args.model} ({dense:,} bytes) -> {args.output} ({res.bytes:,} bytes): {dense / res.bytes:.1f}x smaller")
    for t in res.tensors:
        print(f"  {t['name']}: {t['dtype']} {list(t['shape'])}, layout {t['layout']}, {'+'.join(t['codecs'])}, "
              f"{t['raw_bytes']:,} -> {t['bytes']:,} bytes")
    if sizes is not None:
        print("file size by codec: " + ", ".join(f"{c} {b:,}" for c, b in sizes.items()))
    return 0


def _cmd_unpack(args: argparse.Namespace) -> int:
    import os

    import numpy as np

    from ..core.atomic import atomic_path
    from ..core.cmpk import unpack
    from ..core.npz import save_npz

    suffix = os.path.splitext(args.output)[1].lower()
    if _is_checkpoint_dir(args.packed):  # a compressed-tensors checkpoint folder -> float weights
        from ..core.compressed_tensors import load_compressed_tensors, write_safetensors

        if suffix not in (".npz", ".safetensors"):
            raise ConfigError(f"cannot write {args.output!r}: a compressed-tensors checkpoint unpacks to .npz or "
                              f".safetensors")
        arrays = load_compressed_tensors(args.packed, max_bytes=args.max_bytes)  # checked before OUT is touched
        with atomic_path(args.output) as tmp:
            if suffix == ".npz":
                save_npz(tmp, arrays)  # not np.savez(**arrays): a tensor named 'file' would break it
            else:
                write_safetensors(tmp, arrays)
        print(f"{args.packed} -> {args.output}: {len(arrays)} tensors")
        return 0
    arrays = unpack(args.packed, max_bytes=args.max_bytes)
    if suffix == ".npz":
        with atomic_path(args.output) as tmp:
            save_npz(tmp, arrays)
    elif suffix in (".pt", ".pth"):
        try:
            import torch
        except ImportError:
            raise BackendNotAvailable("writing a .pt file needs torch (pip install 'compressor[torch]')") from None
        with atomic_path(args.output) as tmp:
            with open(tmp, "wb") as f:  # a file object: a failed write surfaces as an OSError, not torch's text
                torch.save({k: torch.from_numpy(np.array(v, order="C")) for k, v in arrays.items()}, f)
    elif suffix == ".keras":
        if args.model is None:
            raise ConfigError("unpacking to .keras needs --model ARCH.keras (a .keras file of the same model whose "
                              "architecture receives the weights)")
        from .report import load_keras

        model = load_keras(args.model)  # ModelError (missing, not a .keras archive) / BackendNotAvailable
        from ..tf.cmpk import load_compressed

        load_compressed(model, args.packed)
        with atomic_path(args.output) as tmp:
            model.save(tmp)
    else:
        raise ConfigError(f"cannot write {args.output!r}: allowed outputs are .npz, .pt/.pth (torch state_dict) "
                          f"and .keras (with --model)")
    print(f"{args.packed} -> {args.output}: {len(arrays)} tensors")
    return 0


# ---------------------------------------------------------------------------------------------- oneshot
def _cmd_oneshot(args: argparse.Namespace) -> int:
    import os

    def report(summary: dict[str, Any]) -> int:
        rows = summary["rows"]
        if rows:
            from ..core.oneshot import OneShotReport

            print(OneShotReport(rows))  # per layer: block, method, sparsity / bits, the method's error
        errors = [r["error"] for r in rows if isinstance(r.get("error"), float)]
        print(f"{args.src} -> {args.out}: {summary['blocks']} blocks, {len(rows)} layers compressed, "
              f"{summary['bytes_in'] / 2**20:.1f} MiB -> {summary['bytes_out'] / 2**20:.1f} MiB, "
              + (f"mean layer error {sum(errors) / len(errors):.4g}, " if errors else "")
              + f"{summary['seconds']:.1f} s")
        if summary["dense_notes"]:
            print(f"written as float weights: {', '.join(summary['dense_notes'])}")
        return 0

    if not os.path.isfile(os.path.join(args.src, "config.json")):
        raise ConfigError(f"SRC_DIR {args.src!r} has no config.json: give a Hugging Face checkpoint folder "
                          f"(config.json + safetensors) or a keras-hub preset folder (config.json + "
                          f"model.weights.h5, as save_to_preset writes it)")
    keras_preset = False  # keras-hub's own test: a config.json naming a registered Keras object
    for name, key in (("config.json", "registered_name"), ("metadata.json", "keras_version")):
        try:
            with open(os.path.join(args.src, name), encoding="utf-8") as f:
                keras_preset = keras_preset or key in json.load(f)
        except (OSError, ValueError, TypeError):
            pass
    if keras_preset:
        if args.workers != 1:
            raise ConfigError(f"--workers {args.workers}: a keras-hub preset is compressed by one process; run with "
                              f"--workers 1")
        if args.sparse_format != "dense":
            raise ConfigError(f"--sparse-format {args.sparse_format}: a keras-hub preset holds pruned layers as float "
                              f"weights with their zeros (what Keras runs); the option is for Hugging Face checkpoints")
        try:
            from ..tf.hub_oneshot import oneshot as keras_oneshot
        except ModuleNotFoundError as e:
            raise BackendNotAvailable(f"compressor oneshot on a keras-hub preset needs {e.name!r} (pip install "
                                      f"'compressor[tf]' keras-hub h5py)") from None
        if not os.path.isfile(args.recipe):
            _no_file(args.recipe)
        return report(keras_oneshot(args.src, args.out, args.recipe, args.data, num_samples=args.num_samples,
                                    seq_len=args.seq_len, batch_size=args.batch_size,
                                    forward_dtype=args.forward_dtype, progress=True))
    try:
        from ..torch.hf_oneshot import oneshot
    except ModuleNotFoundError as e:
        raise BackendNotAvailable(f"compressor oneshot needs {e.name!r} (pip install 'compressor[torch,hf,llm]')") from None
    if not os.path.isfile(args.recipe):
        _no_file(args.recipe)
    summary = oneshot(args.src, args.out, args.recipe, args.data, num_samples=args.num_samples, seq_len=args.seq_len,
                      batch_size=args.batch_size, forward_dtype=args.forward_dtype, sparse_format=args.sparse_format,
                      workers=args.workers, threads=args.threads, progress=True)
    return report(summary)


def _no_file(path: str) -> NoReturn:
    raise ConfigError(f"--recipe {path!r}: no such file (a YAML list of stages, e.g. '- GptqQuantizer: "
                      f"[{{quant_bits: 4, op_types: [Linear]}}]')")


# ---------------------------------------------------------------------------------------------- demo
def _cmd_demo(args: argparse.Namespace) -> int:
    argv = list(getattr(args, "args", []) or [])
    try:
        demo = importlib.import_module(f"{__package__}.demo")
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.demo":  # the demo exists but needs a package that is missing
            raise BackendNotAvailable(f"compressor demo needs {e.name!r}, which is not installed "
                                      f"(pip install 'compressor[all,demo]')") from None
    else:
        return int(demo.main(argv) or 0)
    print("compressor demo: the training demo arrives with the examples; installed backends and algorithms:")
    return _cmd_list(argparse.Namespace(json=False))


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="compressor", description="Pruning and quantization for PyTorch and Keras 3")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ls = sub.add_parser("list", help="backends and algorithms installed (incl. plugins)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=_cmd_list)

    ck = sub.add_parser("check", help="validate a YAML config file and print it normalised",
                        description="Validate CONFIG (a bare list of dicts, or seed 004's 'AlgorithmName: "
                                    "{config: [...]}' sections) and print the normalised config as YAML.")
    ck.add_argument("config", metavar="CONFIG.yaml")
    ck.add_argument("--algorithm", metavar="NAME",
                    help="validate with this algorithm's keys (default: the section names, when they are "
                         "algorithm names such as tfAGPruner)")
    ck.add_argument("--backend", choices=("torch", "tf"), help="backend whose algorithm class is used")
    ck.set_defaults(func=_cmd_check)

    rp = sub.add_parser("report", help="per-layer sparsity / bits table of an exported model",
                        description="Per-layer sparsity and bit widths of an exported model: a torch state_dict "
                                    "(.pt/.pth), a Keras model (.keras), a .npz of weights, or a deployable "
                                    "artifact (.onnx, .tflite: the weights as the runtime stores them).")
    rp.add_argument("model", metavar="MODEL_FILE", help="a model file, or a compressed-tensors checkpoint folder "
                                                       "(bits, group size, sparsity and bytes per layer)")
    rp.add_argument("--masks", metavar="MASKS", help="mask file from export_model (.pt or .npz)")
    rp.add_argument("--calibration", metavar="FILE", help="calibration file from a quantizer's export_model")
    rp.add_argument("--plot", metavar="OUT.png", help="draw per-layer sparsity with matplotlib")
    rp.add_argument("--flops", action="store_true",
                    help="also MACs per sample and params, dense vs. after structured speedup (on a copy); "
                         "torch files need --model-fn and --input-shape")
    rp.add_argument("--input-shape", metavar="SHAPE",
                    help="torch: input shape with the batch dimension, e.g. 1,3,32,32 (implies --flops)")
    rp.add_argument("--model-fn", metavar="MODULE:CALLABLE",
                    help="torch: a callable that builds the model the state_dict belongs to (implies --flops)")
    rp.add_argument("--artifact", metavar="FILE", action="append", default=[],
                    help="an exported artifact (.onnx, .tflite, SavedModel dir, ...) whose size on disk is listed "
                         "next to MODEL_FILE's (repeatable)")
    rp.add_argument("--json", action="store_true",
                    help="machine-readable output (with --flops / --artifact: {'layers': [...], 'flops': {...}, "
                         "'files': [...]})")
    rp.add_argument("--max-bytes", metavar="SIZE", type=_size, default=None, help=_MAX_BYTES_HELP)
    rp.set_defaults(func=_cmd_report)

    pk = sub.add_parser("pack", help="write an exported model as a compressed file (Deep Compression storage)",
                        description="Store MODEL_FILE (a torch state_dict .pt/.pth, a Keras .keras file or a .npz of "
                                    "weights, e.g. from export_model) as a compressed file: only the non-zero "
                                    "values, their positions (bitmask or relative indices) and an entropy coder "
                                    "per stream (Huffman, zlib, lzma: 'auto' keeps the smallest). Read it back with "
                                    "'compressor unpack', compressor.unpack() or load_compressed().")
    pk.add_argument("model", metavar="MODEL_FILE")
    pk.add_argument("output", metavar="OUT")
    pk.add_argument("--codec", choices=("auto", "huffman", "zlib", "lzma", "raw"), default="auto",
                    help="entropy coder of every stream (default auto: the smallest per stream)")
    pk.add_argument("--compare", action="store_true", help="also report the file size with each codec")
    pk.add_argument("--json", action="store_true", help="machine-readable output")
    pk.set_defaults(func=_cmd_pack)

    up = sub.add_parser("unpack", help="turn a compressed file back into weights (.npz, .pt or .keras)",
                        description="Decode PACKED (written by 'compressor pack' or export_model(compressed_path=...)) "
                                    "into OUT: .npz (any backend), .pt/.pth (a torch state_dict, loadable into the "
                                    "original model class) or .keras (with --model: a .keras file of the same model "
                                    "whose architecture receives the weights). The values are bit-identical.")
    up.add_argument("packed", metavar="PACKED", help="a compressed file, or a compressed-tensors checkpoint folder "
                                                    "(unpacked to float weights in .npz / .safetensors)")
    up.add_argument("output", metavar="OUT")
    up.add_argument("--model", metavar="ARCH.keras", help="for a .keras OUT: the model file giving the architecture")
    up.add_argument("--max-bytes", metavar="SIZE", type=_size, default=None, help=_MAX_BYTES_HELP)
    up.set_defaults(func=_cmd_unpack)

    os_ = sub.add_parser("oneshot", help="compress a language-model checkpoint block by block, disk to disk",
                         description="Compress the Hugging Face checkpoint SRC_DIR (config.json + safetensors) with "
                                     "the one-shot RECIPE, one decoder block in memory at a time, into a "
                                     "compressed-tensors checkpoint OUT_DIR that transformers loads. Killed, the "
                                     "same command continues at the first unfinished block (progress in "
                                     "OUT_DIR.partial); OUT_DIR appears whole at the end.")
    os_.add_argument("src", metavar="SRC_DIR")
    os_.add_argument("out", metavar="OUT_DIR")
    os_.add_argument("--recipe", required=True, metavar="RECIPE.yaml",
                     help="a YAML list of stages, each {AlgorithmName: config_list} (WandaPruner, SparseGPTPruner, "
                          "GptqQuantizer, RtnQuantizer, AwqQuantizer)")
    os_.add_argument("--data", required=True, metavar="PATH",
                     help="calibration data: a text file or folder (tokenized with SRC_DIR's tokenizer.json), or a "
                          ".npy / .pt integer array [sequences, length] of token ids")
    os_.add_argument("--num-samples", type=int, default=128, help="calibration sequences (default 128)")
    os_.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    os_.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")
    os_.add_argument("--forward-dtype", choices=("model", "float64", "auto"), default="model",
                     help="dtype of the block passes (default model: the checkpoint's)")
    os_.add_argument("--sparse-format", choices=("dense", "bitmask", "2:4", "auto"), default="dense",
                     help="how pruned layers are stored (default dense)")
    os_.add_argument("--workers", type=int, default=1,
                     help="processes to split the run over (default 1): each calibrates on its share of the "
                          "sequences, the statistics are summed over all, a block's layers are solved in parallel. "
                          "Under torchrun, each process runs the command and the launcher's processes are used")
    os_.add_argument("--threads", type=int, default=None,
                     help="torch threads per process (default: the CPUs divided by --workers)")
    os_.set_defaults(func=_cmd_oneshot)

    demo = sub.add_parser("demo", help="run the demo (arguments go to the demo)", add_help=False)
    demo.add_argument("args", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # everything after 'demo' belongs to the demo, options included
        args = argparse.Namespace(func=_cmd_demo, args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, ModelError, BackendNotAvailable, OSError, CompressedFileError) as e:
        # OSError: an output that is a directory, a read-only or full file system, a name too long
        print(f"compressor: error: {_one_line(e)}", file=sys.stderr)
        return BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
