"""Test-suite wiring.

* Tests under tests/torch and files named ``*_torch.py`` get the ``torch`` marker, tests/tf and ``*_tf.py``
  get ``tf``, tests/parity get both; tox envs select by marker.
* ``COMPRESSOR_REQUIRE_BACKENDS=torch,tf`` (set by tox, and implied for both by ``CI=true``) turns a
  missing framework into an ERROR instead of a skip: in CI a backend test is never silently skipped.
* ``mnist_dir`` fixture: ``$COMPRESSOR_MNIST_DIR`` or ``../shared/data/mnist``; skips when absent (fails in CI).
* Hypothesis runs without its per-example deadline and "too slow" health check: bounds on time belong in
  benchmarks/, not in tests (a busy CI machine is slow, not wrong).
* ``text_corpus`` fixture: ``$COMPRESSOR_TEXT_CORPUS`` or ``../shared/data/text/vim-help.tar.gz``; likewise.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

try:  # no property test times the machine: Hypothesis's per-example deadline and its "too slow" check are off
    from hypothesis import HealthCheck, settings

    settings.register_profile("compressor", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("compressor")
except ImportError:  # hypothesis is a test extra; the suites that use it import it themselves
    pass

FRAMEWORK = {"torch": "torch", "tf": "tensorflow"}
ROOT = Path(__file__).resolve().parent.parent


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def required_backends() -> set[str]:
    raw = os.environ.get("COMPRESSOR_REQUIRE_BACKENDS")
    if raw is None:
        return set(FRAMEWORK) if in_ci() else set()
    return {b.strip() for b in raw.split(",") if b.strip()}


def require(backend: str):
    """Import the framework of ``backend`` or skip; an error instead when the backend is required."""
    mod = FRAMEWORK[backend]
    if backend in required_backends():
        return importlib.import_module(mod)  # ImportError here = the test fails, as it must in CI
    return pytest.importorskip(mod, reason=f"{mod} not installed (backend {backend!r})")


def _markers_for(path: Path) -> set[str]:
    rel = path.resolve().relative_to(ROOT / "tests").parts
    out = set()
    if rel[0] == "torch" or path.stem.endswith("_torch"):
        out.add("torch")
    if rel[0] == "tf" or path.stem.endswith("_tf"):
        out.add("tf")
    if rel[0] == "parity":
        out |= {"torch", "tf"}
    return out


def pytest_ignore_collect(collection_path, config):
    """Do not even import backend test modules whose framework is absent, unless it is required
    (then the import error fails the run). Test modules can therefore ``import torch`` at the top."""
    p = Path(str(collection_path))
    try:
        marks = _markers_for(p)
    except (ValueError, IndexError):
        return None
    for backend in marks:
        if backend not in required_backends() and importlib.util.find_spec(FRAMEWORK[backend]) is None:
            return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        for m in _markers_for(Path(str(item.fspath))):
            item.add_marker(getattr(pytest.mark, m))


def pytest_runtest_setup(item):
    for backend in FRAMEWORK:
        if item.get_closest_marker(backend):
            require(backend)


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    d = Path(os.environ.get("COMPRESSOR_MNIST_DIR", ROOT.parent / "shared" / "data" / "mnist"))
    if not (d / "train-images-idx3-ubyte.gz").is_file():
        if in_ci():
            pytest.fail(f"MNIST IDX files not found in {d} (set COMPRESSOR_MNIST_DIR)")
        pytest.skip(f"MNIST IDX files not found in {d}")
    return d


@pytest.fixture(scope="session")
def text_corpus() -> Path:
    p = Path(os.environ.get("COMPRESSOR_TEXT_CORPUS", ROOT.parent / "shared" / "data" / "text" / "vim-help.tar.gz"))
    if not p.exists():
        if in_ci():
            pytest.fail(f"text corpus not found at {p} (set COMPRESSOR_TEXT_CORPUS)")
        pytest.skip(f"text corpus not found at {p}")
    return p


def _missing_package_skip(report) -> bool:
    """A skip from ``pytest.importorskip`` ("could not import 'x'")."""
    if not report.skipped:
        return False
    text = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    return "could not import" in text


def _strict_in_ci(path: Path) -> bool:
    """In CI, a backend test (torch / tf / parity) whose env is required never skips for a missing package:
    every package such a test imports is installed by its tox env's extras, so a skip hides a broken env."""
    if not in_ci():
        return False
    try:
        marks = _markers_for(path)
    except (ValueError, IndexError):
        return False
    return bool(marks) and marks <= required_backends()


def _fail_instead(report, where: str) -> None:
    text = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{where}: {text} (in CI the test env installs this package; a skip would hide it)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if _missing_package_skip(rep) and _strict_in_ci(Path(str(item.fspath))):
        _fail_instead(rep, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    rep = outcome.get_result()
    path = getattr(collector, "path", None)
    if path is not None and path.suffix == ".py" and _missing_package_skip(rep) and _strict_in_ci(Path(str(path))):
        _fail_instead(rep, str(path))


@pytest.fixture(autouse=True, scope="session")
def _ctrl_c_raises():
    """The tests that press Ctrl-C (SIGINT to this process) need it to raise KeyboardInterrupt, as it does in a
    terminal. A run started as a background job of a non-interactive shell (``cmd &`` in a script) inherits
    SIGINT ignored, and Python then installs no handler: those tests would see nothing. Python's own handler is
    installed for the session in that case."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
