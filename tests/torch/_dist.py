"""Helpers for the multi-process (gloo, CPU) tests: start ranks that cannot hang the test run.

A CI run once stalled for 90 minutes inside the first gloo test. Three things make the ranks safe on any
machine: gloo is pinned to the loopback interface (by default it binds to whatever the host name resolves
to, which in a sandbox may be an interface nobody can reach), the ranks are started with ``spawn`` (a
forked child inherits the locks of every thread the test process has started before: OpenMP, tokenizers),
and every wait has a deadline after which the ranks are killed and the test fails. The deadline is for a stuck
rank, not a measure of speed: it leaves a busy machine (several times slower than a quiet one) ample time,
and lies under pytest-timeout's 900 s (pyproject.toml) so that the ranks are killed here, with a message;
if the test is ended any other way (pytest-timeout, Ctrl-C), the ranks are killed too.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 840  # a rank that has not finished by then is stuck, not slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, world: int, port: int) -> None:
    """Join the gloo group of ``world`` ranks on localhost (one intra-op thread per rank)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=DEADLINE_S // 2))


def _rank_main(rank: int, worker, *args) -> None:
    worker(rank, *args)
    # A spawned rank ends with a normal interpreter exit, whose C++ static destructors can meet a still
    # joinable gloo/store thread ("terminate called without an active exception", SIGABRT) after all the
    # work is done. Leave the way a forked child does. (A raised exception skips this and is reported.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, *args, nprocs: int = 2, deadline_s: float = DEADLINE_S) -> None:
    """Run ``worker(rank, nprocs, port, *args)`` in ``nprocs`` fresh processes; fail after ``deadline_s``."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # inherited by the ranks before they import anything
    ctx = mp.start_processes(_rank_main, args=(worker, nprocs, free_port(), *args), nprocs=nprocs, join=False,
                             start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=5):  # raises ProcessRaisedException if a rank failed
            if time.monotonic() > end:
                raise TimeoutError(f"distributed ranks did not finish within {deadline_s} s (killed)")
    finally:  # on the deadline, a failed rank, or the test being ended: no rank outlives the test
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
