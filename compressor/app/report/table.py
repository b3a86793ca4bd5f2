"""The report's rows (:class:`LayerStats`: zeros, mask, bits per layer), its text table, JSON dicts and plot,
and the file sizes of ``--artifact``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ...core.errors import BackendNotAvailable, ConfigError


@dataclass
class LayerStats:
    """One row of the report."""

    layer: str
    shape: tuple[int, ...]
    params: int
    zeros: int
    sparsity: float  # fraction of weights equal to zero
    masked: float | None  # fraction pruned by the mask file, if one was given
    distinct: int  # distinct non-zero values
    bits: int
    bits_source: str  # 'calibration', 'distinct values' or 'dtype'
    dtype: str = ""  # the stored element type (float32, int8, ...)
    group_size: int | None = None  # Keras-quantized layers: input columns per scale (-1: per channel)
    bytes: int | None = None  # Keras-quantized layers: bytes of codes + scales + zero points (no bias)


def _bits(weight: np.ndarray, nonzero: np.ndarray) -> tuple[int, int, str]:
    """(distinct non-zero values, bits, how the bits were found) without calibration."""
    distinct = int(np.unique(nonzero).size)
    if weight.dtype.kind in "iu":  # stored integer codes: the container is the bit width
        return distinct, int(weight.dtype.itemsize * 8), "dtype"
    levels = distinct + (1 if nonzero.size < weight.size else 0)
    # many repeats (fewer levels than half the non-zero weights) only happen on a quantization grid
    if 0 < distinct <= max(1, nonzero.size // 2) and levels <= 2**16:
        return distinct, max(1, math.ceil(math.log2(levels))), "distinct values"
    return distinct, int(weight.dtype.itemsize * 8), "dtype"


def layer_stats(weights: list[tuple[str, np.ndarray]], masks: dict[str, np.ndarray] | None = None,
                calibration: dict[str, int] | None = None,
                quantized: dict[str, dict[str, Any]] | None = None) -> list[LayerStats]:
    """Rows of the report. Masks and calibration entries must name layers of the model (ConfigError).
    ``quantized`` (:func:`read_weights_info`): the bits, group size and stored bytes of Keras-quantized layers
    (their weight rows are ``code - zero point``); with it, every row gets its stored bytes."""
    quantized = quantized or {}
    masks = masks or {}
    calibration = calibration or {}
    names = {n for n, _ in weights}
    for what, table in (("mask", masks), ("calibration", calibration)):
        unknown = sorted(set(table) - names)
        if unknown:
            raise ConfigError(f"{what} file names layers the model does not have: {unknown}; "
                              f"model layers: {sorted(names)}")
    rows = []
    for name, w in weights:
        flat = w.reshape(-1)
        nonzero = flat[flat != 0]
        zeros = int(flat.size - nonzero.size)
        masked = None
        if name in masks:
            m = masks[name]
            if m.shape != w.shape:
                raise ConfigError(f"mask of layer {name!r} has shape {m.shape}, the weight {w.shape}")
            masked = float(1.0 - m.mean()) if m.size else 0.0
        distinct, bits, source = _bits(w, nonzero)
        if name in calibration:
            bits, source = calibration[name], "calibration"
        dtype, group, nbytes = str(w.dtype), None, (int(w.nbytes) if quantized else None)
        if name in quantized:
            q = quantized[name]
            bits, source, dtype = int(q["bits"]), f"keras {q['mode']}", f"int{int(q['bits'])}"
            group, nbytes = int(q["group_size"]), int(q["bytes"])
        rows.append(LayerStats(name, tuple(int(s) for s in w.shape), int(flat.size), zeros,
                               zeros / flat.size if flat.size else 0.0, masked, distinct, bits, source,
                               dtype, group, nbytes))
    return rows


def _shown(name: str) -> str:
    """A layer name as any terminal can print it: lone surrogates (a name that is not valid Unicode, possible in a
    pickled or JSON file) and other characters UTF-8 cannot encode are written as ``\\udXXX`` escapes."""
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def format_table(rows: list[LayerStats]) -> str:
    """A plain-text table with a total row; ``~`` marks bit widths estimated from distinct values. Layer names
    are escaped where they are not valid Unicode (:func:`_shown`)."""
    head = ["layer", "shape", "params", "zeros", "sparsity", "masked", "bits"]
    sized = any(r.bytes is not None for r in rows)
    if sized:
        head += ["group", "bytes"]
    body = []
    for r in rows:
        stored = r.dtype or "float"
        bits = {"calibration": f"{r.bits}", "distinct values": f"~{r.bits}",
                "dtype": f"{r.bits} ({stored})"}.get(r.bits_source, f"{r.bits} ({r.bits_source})")
        body.append([_shown(r.layer), "x".join(map(str, r.shape)) or "scalar", str(r.params), str(r.zeros),
                     f"{r.sparsity:.2%}", "-" if r.masked is None else f"{r.masked:.2%}", bits])
        if sized:
            body[-1] += ["-" if r.group_size is None else ("channel" if r.group_size == -1 else str(r.group_size)),
                         "-" if r.bytes is None else f"{r.bytes:,}"]
    params = sum(r.params for r in rows)
    zeros = sum(r.zeros for r in rows)
    with_mask = [r for r in rows if r.masked is not None]
    masked = (sum(r.masked * r.params for r in with_mask) / sum(r.params for r in with_mask)) if with_mask else None
    body.append(["total", "", str(params), str(zeros), f"{zeros / params:.2%}" if params else "-",
                 "-" if masked is None else f"{masked:.2%}", ""])
    stored = sum(r.bytes or 0 for r in rows)
    if sized:
        body[-1] += ["", f"{stored:,}"]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(head), line(["-" * w for w in widths])]
    out += [line(r) for r in body[:-1]] + [line(["-" * w for w in widths]), line(body[-1])]
    if sized and params:
        out.append(f"weights: {stored:,} bytes stored vs {4 * params:,} bytes as float32 "
                   f"({stored / (4 * params):.3f}x; biases not counted)")
    if any(r.bits_source == "distinct values" for r in rows):
        out.append("~ bits estimated from the number of distinct values (pass --calibration for exact widths)")
    return "\n".join(out)


def file_sizes(paths: list[str | os.PathLike]) -> list[dict[str, Any]]:
    """``[{'path', 'bytes', 'ratio'}]``: each file's size on disk (a SavedModel directory: all its files)
    and its ratio to the first one."""
    out: list[dict[str, Any]] = []
    for path in paths:
        p = os.fspath(path)
        if os.path.isdir(p):
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs)
        elif os.path.isfile(p):
            size = os.path.getsize(p)
        else:
            raise ConfigError(f"artifact {p!r} does not exist")
        out.append({"path": p, "bytes": int(size)})
    base = out[0]["bytes"] if out else 0
    for row in out:
        row["ratio"] = row["bytes"] / base if base else None
    return out


def format_sizes(sizes: list[dict[str, Any]]) -> str:
    """``file  bytes  x of the first`` lines of :func:`file_sizes` (paths escaped as :func:`_shown` does)."""
    if not sizes:
        return ""
    wp = max(len(_shown(r["path"])) for r in sizes)
    wb = max(len(f"{r['bytes']:,}") for r in sizes)
    head = sizes[0]["path"]
    lines = []
    for r in sizes:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}x {_shown(os.path.basename(head))}"
        lines.append(f"file  {_shown(r['path']):<{wp}}  {r['bytes']:>{wb},} bytes  {ratio}".rstrip())
    return "\n".join(lines)


def as_dicts(rows: list[LayerStats]) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts (``group_size`` / ``bytes`` only where known: Keras-quantized files)."""
    out = []
    for r in rows:
        d = {**asdict(r), "shape": list(r.shape)}
        for key in ("group_size", "bytes"):  # Keras-quantized files only
            if d[key] is None:
                del d[key]
        out.append(d)
    return out


def plot(rows: list[LayerStats], path: str | os.PathLike) -> None:
    """Bar chart of per-layer sparsity (and mask sparsity) saved to ``path`` (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BackendNotAvailable("--plot needs matplotlib (pip install 'compressor[demo]')") from None
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(rows) + 2), 3.5))
    has_mask = any(r.masked is not None for r in rows)
    width = 0.4 if has_mask else 0.8
    ax.bar(x - (width / 2 if has_mask else 0), [r.sparsity for r in rows], width, label="zero weights")
    if has_mask:
        ax.bar(x + width / 2, [r.masked or 0.0 for r in rows], width, label="masked")
    ax.set_xticks(x, [_shown(r.layer) for r in rows], rotation=45, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel("sparsity")
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(os.fspath(path))
    except OSError as e:
        raise ConfigError(f"cannot write plot {os.fspath(path)!r} ({e.strerror or e})") from None
    finally:
        plt.close(fig)
