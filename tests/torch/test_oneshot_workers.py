"""compressor.torch.oneshot split over processes (``workers=2``; under torchrun, each process calling it): the
calibration sequences shared out, the statistics summed over the processes, the layers of a block solved by
different processes: the single-process checkpoint, whether the processes were started by the call or by a
launcher, and a run whose process is killed continues to the same checkpoint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("accelerate")

from compressor.core.compressed_tensors import load_compressed_tensors  # noqa: E402
from compressor.core.errors import ConfigError  # noqa: E402
from compressor.torch.hf_oneshot import oneshot  # noqa: E402
from tests.torch.test_hf_oneshot import AWQ, GPTQ, SPARSEGPT, llama, tensors_of, tokens  # noqa: E402

KW = dict(num_samples=8, seq_len=32, batch_size=2, progress=False)


def nll(folder, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return float(model(ids, labels=ids).loss)


@pytest.mark.parametrize("recipe", [SPARSEGPT, GPTQ, AWQ], ids=["sparsegpt", "gptq", "awq"])
def test_two_processes_write_the_single_process_checkpoint(tmp_path, recipe):
    src = llama(tmp_path, layers=2)
    path, ids = tokens(tmp_path)
    oneshot(src, tmp_path / "one", recipe, str(path), **KW)
    summary = oneshot(src, tmp_path / "two", recipe, str(path), workers=2, threads=1, **KW)
    assert summary["blocks"] == 2 and len(summary["rows"]) == 14 and summary["rank"] == 0
    assert not (tmp_path / "two.partial").exists()
    one, two = tensors_of(tmp_path / "one"), tensors_of(tmp_path / "two")
    assert sorted(one) == sorted(two)
    # masks equal; codes equal but for entries at float-rounding ties (the sums over processes add in another
    # order): counted, at most one in a thousand
    dense_one, dense_two = load_compressed_tensors(str(tmp_path / "one")), load_compressed_tensors(str(tmp_path / "two"))
    for k in dense_one:
        np.testing.assert_array_equal(dense_one[k] == 0, dense_two[k] == 0, err_msg=k)
    differing = sum(int(np.count_nonzero(one[k] != two[k])) for k in one)
    total = sum(one[k].size for k in one)
    assert differing <= total // 1000, (differing, total)
    assert json.loads((tmp_path / "one" / "config.json").read_text()) == json.loads(
        (tmp_path / "two" / "config.json").read_text())
    assert abs(nll(tmp_path / "one", ids) - nll(tmp_path / "two", ids)) <= 1e-4


def test_more_processes_than_batches_is_refused_before_anything_starts(tmp_path):
    src = llama(tmp_path, layers=2)
    path, _ = tokens(tmp_path)
    with pytest.raises(ConfigError, match="3 processes need at least 3 calibration batches, there are 2"):
        oneshot(src, tmp_path / "out", GPTQ, str(path), num_samples=8, seq_len=32, batch_size=4, workers=3,
                progress=False)
    with pytest.raises(ConfigError, match="workers: a positive number"):
        oneshot(src, tmp_path / "out", GPTQ, str(path), workers=0, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


RANK = r"""
import os, signal, sys, types
import compressor.core.oneshot.stream as stream
import compressor.torch.hf_oneshot as h

kill_at, count = int(sys.argv[1]), [0]

def step():
    count[0] += 1
    if count[0] == kill_at and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)

def wrap(owner, name):
    real = getattr(owner, name)
    def patched(*a, **k):
        step()
        return real(*a, **k)
    setattr(owner, name, patched)

wrap(stream.RunStore, "mark_done")
wrap(h, "_save")
# the run's own removals only (patching os.remove itself also counted whatever torch or a library removed, a
# number that may vary from run to run: the kill then fell on another step, or after the last)
own = types.ModuleType("os")
own.__dict__.update(os.__dict__)
stream.os = own
wrap(own, "remove")
recipe = [{"GptqQuantizer": [{"quant_bits": 4, "group_size": 32, "op_types": ["Linear"]},
                             {"op_names": ["lm_head"], "exclude": True}]}]
s = h.oneshot(sys.argv[2], sys.argv[3], recipe, sys.argv[4], num_samples=8, seq_len=32, batch_size=2,
              progress=False, threads=1)
print("steps", count[0], "rank", s["rank"], "blocks", s["blocks"])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_processes_started_by_a_launcher_and_one_killed_at_each_step_resume_to_the_same_checkpoint(tmp_path):
    """Two processes started as torchrun starts them (RANK / WORLD_SIZE / MASTER_ADDR), each calling oneshot; process
    1 SIGKILLed just before each of its file operations (the launcher then stops the other): the same call with
    ``workers=2`` continues to the checkpoint of an uninterrupted run."""
    src = llama(tmp_path, layers=2)
    path, _ = tokens(tmp_path)
    (tmp_path / "rank.py").write_text(RANK)
    oneshot(src, tmp_path / "ref", GPTQ, str(path), workers=2, threads=1, **{**KW, "progress": False})
    want = tensors_of(tmp_path / "ref")
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path]), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1"}

    def launch(kill_at, out):
        env = {**base, "MASTER_PORT": str(_free_port())}
        procs = [subprocess.Popen([sys.executable, str(tmp_path / "rank.py"), str(kill_at), str(src), str(out),
                                   str(path)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in range(2)]
        second = procs[1].wait(timeout=1800)
        if second != 0:  # what a launcher does when a process dies: stop the others
            procs[0].kill()
        first = procs[0].wait(timeout=1800)
        return first, second, [p.stdout.read() + p.stderr.read() for p in procs]

    first, second, outs = launch(0, tmp_path / "full")
    assert (first, second) == (0, 0), outs
    assert "rank 0 blocks 2" in outs[0] and "rank 0 blocks 2" in outs[1]  # every process returns process 0's summary
    steps = int(outs[1].split()[1])
    assert steps >= 4
    got = tensors_of(tmp_path / "full")
    assert all(np.array_equal(got[k], want[k]) for k in want)
    for k in range(1, steps + 1):
        out = tmp_path / f"out{k}"
        first, second, outs = launch(k, out)
        assert second == -9, (k, steps, outs)
        if not out.exists():  # (killed after process 0 wrote the checkpoint: nothing left to do)
            oneshot(src, out, GPTQ, str(path), workers=2, threads=1, **KW)
        assert not (tmp_path / f"out{k}.partial").exists()
        got = tensors_of(out)
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"kill {k}: {key}")
