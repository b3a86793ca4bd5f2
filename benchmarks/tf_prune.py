"""TF / Keras 3 pruning overhead: ``model.fit`` step time of a pruned small CNN vs the same dense model.

Side by side in one process, interleaved rounds (target: pruned <= 1.05x dense). Ratios are paired: each
variant's time over the dense model's time in the same round, then the median (and 25th-75th percentile)
over rounds, so slow drifts of a shared machine cancel. Each figure is
given as wall time and as process CPU time (user + system): on a shared machine the CPU time is far less
disturbed by other processes; ``--threads`` (default 1) pins TF's thread pools so both are stable.

* ``dense``         plain Keras 3 model
* ``dense-copy``    the same dense model again: its ratio to ``dense`` is the noise floor of the run
* ``ours inplace``  LevelPruner 70 %, default mask_mode: pruned weights zeroed in place after each update
* ``ours forward``  LevelPruner 70 %, mask_mode='forward': ``where(mask, w, 0)`` in every call
* inference (``predict_on_batch``) for the same three.

tfmot's ``prune_low_magnitude`` only works on Keras 2 (``tf_keras``), so it runs in its own process with
``TF_USE_LEGACY_KERAS=1`` when ``tensorflow_model_optimization`` and ``tf_keras`` are importable there
(``--tfmot-path DIR`` adds DIR to that process's ``sys.path``, e.g. a ``pip install --target DIR``), with
its own dense baseline; otherwise the output says so.

    python benchmarks/tf_prune.py [--rounds 15] [--steps 10] [--threads 1] [--tfmot-path DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

BATCH, SHAPE, CLASSES, SPARSITY = 64, (32, 32, 3), 10, 0.7


def build(keras):
    L = keras.layers
    return keras.Sequential([
        keras.Input(SHAPE), L.Conv2D(32, 3, activation="relu"), L.Conv2D(64, 3, activation="relu"),
        L.MaxPooling2D(), L.Flatten(), L.Dense(128, activation="relu"), L.Dense(CLASSES),
    ])


def data(np, n):
    rng = np.random.default_rng(0)
    return rng.random((n, *SHAPE), dtype=np.float32), rng.integers(0, CLASSES, n)


def clocks():
    return time.perf_counter(), time.process_time()


def per_step(start, steps):
    wall, cpu = clocks()
    return (wall - start[0]) / steps, (cpu - start[1]) / steps


def time_fit(model, x, y, steps):
    """(wall, cpu) seconds per step of model.fit over ``steps`` batches (one epoch, graph mode)."""
    t = clocks()
    model.fit(x[: steps * BATCH], y[: steps * BATCH], batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    return per_step(t, steps)


def time_predict(model, x, steps):
    t = clocks()
    for i in range(steps):
        model.predict_on_batch(x[i * BATCH:(i + 1) * BATCH])
    return per_step(t, steps)


def medians(samples):
    return tuple(statistics.median(s[i] for s in samples) for i in (0, 1))


def run_ours(rounds, steps):
    import keras
    import numpy as np
    import tensorflow as tf

    from compressor.tf import LevelPruner

    x, y = data(np, steps * BATCH)
    models = {}
    pruners = {}
    for name in ("dense", "dense-copy", "ours inplace", "ours forward"):
        keras.utils.set_random_seed(0)
        m = build(keras)
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        if name.startswith("ours"):
            cls = LevelPruner if name == "ours inplace" else type("FwdLevelPruner", (LevelPruner,), {"mask_mode": "forward"})
            pruners[name] = cls(m, [{"sparsity": SPARSITY, "op_types": ["default"]}], opt)
            pruners[name].compress()
        m.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        time_fit(m, x, y, 2)  # trace + warm up
        time_predict(m, x, 2)
        models[name] = m
    remask = tf.function(pruners["ours inplace"].apply_masks)  # what the hook adds to each inplace step
    remask()
    fit = {n: [] for n in models}
    pred = {n: [] for n in models}
    extra = []
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for n in order:
            fit[n].append(time_fit(models[n], x, y, steps))
            pred[n].append(time_predict(models[n], x, steps))
        t = clocks()
        for _ in range(50):
            remask()
        extra.append(per_step(t, 50))
    pruned = models["ours inplace"]
    zeros = float(np.mean([np.mean(v.numpy() == 0) for v in pruned.trainable_variables if len(v.shape) > 1]))
    return fit, pred, medians(extra), zeros


TFMOT_SCRIPT = r"""
import json, os, statistics, sys, time
sys.path[:0] = [p for p in os.environ.get("TFMOT_PATH", "").split(os.pathsep) if p]
import numpy as np, tensorflow as tf, tensorflow_model_optimization as tfmot
keras = tf.keras
threads = int(os.environ.get("BENCH_THREADS", "0"))
if threads:
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
exec(os.environ["BENCH_HELPERS"])
rounds, steps = int(sys.argv[1]), int(sys.argv[2])
x, y = data(np, steps * BATCH)
models = {}
for name in ("dense", "dense-copy", "tfmot"):
    tf.random.set_seed(0)
    m = build(keras)
    cbs = []
    if name == "tfmot":
        m = tfmot.sparsity.keras.prune_low_magnitude(
            m, pruning_schedule=tfmot.sparsity.keras.ConstantSparsity(SPARSITY, 0, frequency=100))
        cbs = [tfmot.sparsity.keras.UpdatePruningStep()]
    m.compile(keras.optimizers.SGD(0.01, momentum=0.9), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    m._bench_cbs = cbs
    models[name] = m
def fit(m, n):
    t = clocks()
    m.fit(x[: n * BATCH], y[: n * BATCH], batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=m._bench_cbs)
    return per_step(t, n)
for m in models.values():
    fit(m, 2); time_predict(m, x, 2)
res = {n: [] for n in models}; pred = {n: [] for n in models}
for r in range(rounds):
    for n in (models if r % 2 == 0 else list(reversed(list(models)))):
        res[n].append(fit(models[n], steps)); pred[n].append(time_predict(models[n], x, steps))
print(json.dumps({"fit": res, "predict": pred}))
"""


def run_tfmot(rounds, steps, path, threads):
    import inspect

    helpers = "\n".join(inspect.getsource(f) for f in (build, data, clocks, per_step, time_predict))
    helpers = f"BATCH, SHAPE, CLASSES, SPARSITY = {BATCH}, {SHAPE}, {CLASSES}, {SPARSITY}\n" + helpers
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TFMOT_PATH=path or "", BENCH_HELPERS=helpers,
               BENCH_THREADS=str(threads))
    probe = subprocess.run([sys.executable, "-c", "import os,sys; sys.path[:0]=[p for p in os.environ['TFMOT_PATH']"
                            ".split(os.pathsep) if p]; import tf_keras, tensorflow_model_optimization"],
                           env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        return None, (probe.stderr.strip().splitlines() or ["?"])[-1]
    out = subprocess.run([sys.executable, "-c", TFMOT_SCRIPT, str(rounds), str(steps)], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None, (out.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(out.stdout.strip().splitlines()[-1]), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="TF intra/inter-op threads (0 = TF default)")
    ap.add_argument("--tfmot-path", default=os.environ.get("COMPRESSOR_TFMOT_PATH", ""))
    args = ap.parse_args()
    import tensorflow as tf

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    print(f"TF {tf.__version__}; small CNN {SHAPE} batch {BATCH}, LevelPruner {SPARSITY:.0%}; "
          f"{args.rounds} interleaved rounds x {args.steps} steps; TF threads: {args.threads or 'default'}")
    print("ms = median per step; x = median over rounds of (variant / dense in the same round) [25th-75th pct]")
    fit, pred, extra, zeros = run_ours(args.rounds, args.steps)
    table(fit, pred)
    print(f"inplace mask upkeep alone (the re-mask the hook adds per step, tf.function, median): "
          f"{extra[0] * 1e3:.3f} ms wall / {extra[1] * 1e3:.3f} ms cpu = "
          f"{extra[1] / statistics.median(s[1] for s in fit['dense']):.2%} of a dense step's cpu time; "
          f"predict runs the unchanged graph (no mask op)")
    print(f"weights at zero in the pruned model after training: {zeros:.1%} (target {SPARSITY:.0%})")
    res, why = run_tfmot(args.rounds, args.steps, args.tfmot_path, args.threads)
    if res is None:
        print(f"tfmot: not available with Keras 3 here (prune_low_magnitude needs tf_keras + "
              f"TF_USE_LEGACY_KERAS=1; probe said: {why})")
    else:
        print("tfmot prune_low_magnitude (Keras 2 via tf_keras, own process, own dense baseline):")
        table(res["fit"], res["predict"])


def paired(samples, base, i):
    """(q25, median, q75) of samples[k][i] / base[k][i] over rounds k."""
    r = sorted(a[i] / b[i] for a, b in zip(samples, base))
    return r[len(r) // 4], statistics.median(r), r[(3 * len(r)) // 4]


def table(fit, pred):
    print(f"{'variant':<14}" + "".join(f"{h:>27}" for h in ("fit wall", "fit cpu", "predict wall", "predict cpu")))
    for n in fit:
        cells = []
        for d in (fit, pred):
            for i in (0, 1):
                q1, q2, q3 = paired(d[n], d["dense"], i)
                ms = statistics.median(s[i] for s in d[n]) * 1e3
                cells.append(f"{ms:>8.2f} {q2:>6.3f}x [{q1:.3f}-{q3:.3f}]")
        print(f"{n:<14}" + "".join(cells))


if __name__ == "__main__":
    main()
