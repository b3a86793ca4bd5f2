"""Import isolation: core never imports a framework; each backend never imports the other one."""

import subprocess
import sys

import pytest

ROOT = __file__.rsplit("/tests/", 1)[0]


def loaded_after(stmt: str) -> set[str]:
    code = f"import sys\n{stmt}\nprint('LOADED=' + ','.join(m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=1800,
                         env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin", "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("LOADED="), out.stdout
    return {m for m in last[len("LOADED="):].split(",") if m}


@pytest.mark.parametrize("stmt", [
    "import compressor",
    "import compressor.core",
    "import compressor; compressor.available()",
    "import compressor.app.cli; compressor.app.cli.main(['list'])",
    "import compressor.torch_plugin, compressor.tf_plugin",
])
def test_core_imports_no_framework(stmt):
    assert loaded_after(stmt) == set()


