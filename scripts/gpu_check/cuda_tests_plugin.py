"""pytest plugin of the GPU check: keeps only the tests that skip for want of a CUDA device and records them.

Loaded with ``-p cuda_tests_plugin`` (this folder on ``PYTHONPATH``). A test is a CUDA test when one of its
``skipif`` marks (on the function, its class, its module's ``pytestmark`` or a parametrize ``marks=``) names
CUDA or a GPU in its reason, e.g. ``@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA
device")``; the mark is there whatever its condition evaluates to, so the same tests are found on a CPU
machine (where they skip) and on a GPU machine (where they run).

``GPU_CHECK_RESULTS=path``: after the run, a JSON file with the selected node ids and, per test, its outcome
(passed / failed / skipped / error), its duration and a short reason.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

CUDA_REASON = re.compile(r"\b(cuda|gpu)\b", re.IGNORECASE)


def cuda_skip_reason(item: pytest.Item) -> str | None:
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        if CUDA_REASON.search(reason):
            return reason
    return None


class CudaTests:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self.selected: dict[str, str] = {}
        self.outcomes: dict[str, dict[str, Any]] = {}
        self.collect_errors: list[str] = []

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        keep, drop = [], []
        for item in items:
            reason = cuda_skip_reason(item)
            if reason is None:
                drop.append(item)
            else:
                keep.append(item)
                self.selected[item.nodeid] = reason
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.append(f"{report.nodeid}: {str(report.longrepr).strip().splitlines()[-1:]}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        rec = self.outcomes.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0, "reason": ""})
        rec["seconds"] = round(rec["seconds"] + float(report.duration), 3)
        if report.skipped:
            rec["outcome"] = "skipped"
            lr = report.longrepr
            rec["reason"] = str(lr[2] if isinstance(lr, tuple) else lr)[-300:]
        elif report.failed:
            rec["outcome"] = "failed" if report.when == "call" else "error"
            rec["reason"] = str(report.longrepr).strip().splitlines()[-1][-300:] if report.longrepr else ""

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.path or hasattr(session.config, "workerinput"):
            return  # an xdist worker: the controller, which sees every report, writes the file
        for nodeid in self.outcomes:  # under xdist the controller collects nothing itself
            self.selected.setdefault(nodeid, "(selected in an xdist worker)")
        with open(self.path, "w") as f:
            json.dump({"selected": self.selected, "outcomes": self.outcomes, "exitstatus": int(exitstatus),
                       "collect_errors": self.collect_errors}, f, indent=1)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(CudaTests(os.environ.get("GPU_CHECK_RESULTS")), "gpu_check_cuda_tests")
