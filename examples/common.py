"""Shared pieces of the reproduction scripts: arguments, MNIST, training recipes, measuring, tables.

The training loops are the demo's harnesses (:func:`compressor.app.demo.get_harness`): one object per
backend with ``build``/``fit``/``evaluate``/``export`` helpers, so each recipe below is written once and
runs unchanged on PyTorch and on Keras 3.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compressor.app.data import Dataset, load_mnist
from compressor.app.demo import get_harness, installed_backends

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MNIST = os.environ.get("COMPRESSOR_MNIST_DIR", str(ROOT.parent / "shared" / "data" / "mnist"))
BACKEND_LABEL = {"torch": "ours-torch", "tf": "ours-tf"}


# ------------------------------------------------------------------------------------------ arguments
def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("torch", "tf", "all"), default="all", help="default: every installed one")
    p.add_argument("--data-dir", default=DEFAULT_MNIST, help=f"MNIST IDX files (default {DEFAULT_MNIST})")
    p.add_argument("--quick", action="store_true", help="a few hundred steps on a subset: checks the pipeline only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="CPU threads per framework (0 = framework default)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", metavar="PATH", help="also write the raw results as JSON")
    p.add_argument("--no-progress", action="store_true")


def backends_of(args: argparse.Namespace) -> list[str]:
    if args.backend == "all":
        return installed_backends()
    return [args.backend]


def load_data(args: argparse.Namespace) -> Dataset:
    ds = load_mnist(args.data_dir)
    return ds.subset(6000, 2000) if args.quick else ds


# ------------------------------------------------------------------------------------------ training
@dataclass(frozen=True)
class Train:
    """One training phase: ``epochs`` at ``lr``, multiplied by ``decay`` after every epoch; with
    ``restart`` the decay starts again every ``restart`` epochs (one cycle per prune round)."""

    epochs: int
    lr: float
    batch_size: int = 128
    optimizer: str = "adam"
    decay: float = 1.0
    weight_decay: float = 0.0
    restart: int | None = None

    def lr_at(self, epoch: int) -> float:
        """Learning rate of epoch ``epoch`` (0-based) of this phase."""
        return self.lr * self.decay ** (epoch % self.restart if self.restart else epoch)


def build(h: Any, name: str, ds: Dataset) -> Any:
    """A fresh paper model (``examples.models_torch`` / ``examples.models_tf``) for harness ``h``."""
    if h.name == "torch":
        from examples import models_torch

        return models_torch.build(name, ds.num_classes, ds.image_shape[0]).to(h.device)
    from examples import models_tf

    return models_tf.build(name, ds.num_classes, ds.image_shape[0])


def compile_for(h: Any, model: Any, phase: Train) -> Any:
    """The optimizer of ``phase`` for ``model`` (on Keras also compiles the model with it)."""
    return h.optimizer(model, phase.lr, phase.optimizer, weight_decay=phase.weight_decay)


def train(h: Any, model: Any, ds: Dataset, phase: Train, seed: int, optimizer: Any = None, compressor: Any = None,
          desc: str = "train", progress: bool | None = None) -> Any:
    """Run ``phase`` on ``model`` (a new optimizer unless one is given); returns the optimizer."""
    opt = optimizer if optimizer is not None else compile_for(h, model, phase)
    h.set_lr(opt, phase.lr)

    def decay(epoch: int) -> None:
        if phase.decay != 1.0:
            h.set_lr(opt, phase.lr_at(epoch + 1))

    h.fit(model, opt, ds.x_train, ds.y_train, phase.epochs, phase.batch_size, seed, compressor=compressor,
          desc=desc, progress=progress, epoch_end=decay)
    return opt


def dense_baseline(h: Any, name: str, ds: Dataset, phase: Train, seed: int, progress: bool | None = None) -> Any:
    """A freshly initialised model (seeded) trained by ``phase``."""
    h.seed(seed)
    model = build(h, name, ds)
    train(h, model, ds, phase, seed, desc=f"{name} dense", progress=progress)
    return model


def export_weights(h: Any, pruner: Any, model: Any) -> dict[str, np.ndarray]:
    """Layer -> weight of the model exported by ``pruner`` and read back from the file."""
    with tempfile.TemporaryDirectory() as tmp:
        return h.export_pruned(pruner, model, tmp)


def reload_exported(h: Any, pruner: Any, name: str, ds: Dataset) -> Any:
    """Export through ``pruner`` and load the file into a fresh, plain model (no compressor attached)."""
    with tempfile.TemporaryDirectory() as tmp:
        if h.name == "torch":
            path = os.path.join(tmp, "model.pt")
            pruner.export_model(path)
            model = build(h, name, ds)
            model.load_state_dict(h.torch.load(path, weights_only=True))
            return model
        path = os.path.join(tmp, "model.keras")
        pruner.export_model(path)
        return h.keras.models.load_model(path, compile=False)


def kept_fractions(weights: dict[str, np.ndarray], layers: Sequence[str]) -> tuple[float, dict[str, float]]:
    """(overall, per layer) fraction of non-zero weights over ``layers``."""
    per = {k: float(np.count_nonzero(weights[k]) / weights[k].size) for k in layers}
    total = sum(np.count_nonzero(weights[k]) for k in layers) / sum(weights[k].size for k in layers)
    return float(total), per


class Timer:
    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.t0


def run_backends(args: argparse.Namespace, fn: Callable[[Any, Dataset], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``fn(harness, data)`` for every selected backend, with its thread count applied."""
    ds = load_data(args)
    print(f"data: {ds.describe()}{' (quick subset)' if args.quick else ''}", flush=True)
    out = {}
    for b in backends_of(args):
        h = get_harness(b, args.device)
        with h.threads(args.threads or None), Timer() as t:
            out[b] = fn(h, ds)
        out[b]["seconds"] = round(t.seconds, 1)
        print(f"[{b}] done in {t.seconds:.0f} s", flush=True)
    return out


# ------------------------------------------------------------------------------------------ reporting
def err(acc: float | None) -> str:
    return "-" if acc is None else f"{100.0 * (1.0 - acc):.2f} %"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{100.0 * v:.1f} %"


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def save_json(path: str | None, results: dict[str, Any], args: argparse.Namespace, recipe: Any = None) -> None:
    if not path:
        return
    payload = {"args": vars(args), "results": results}
    if recipe is not None:
        payload["recipe"] = {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in recipe.items()}
    Path(path).write_text(json.dumps(payload, indent=2, default=float))
    print(f"results written to {path}")
