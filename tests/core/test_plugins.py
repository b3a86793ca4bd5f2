"""pluggy plugins: built-in backends, a third-party plugin through the real entry-point group, dispatch."""

import subprocess
import sys
import textwrap

import pytest

import compressor
from compressor.core import registry as R
from compressor.core.hookspecs import hookimpl
from compressor.core.registry import Registry


class ToyPruner:
    """A pretend algorithm: records what it was built with."""

    def __init__(self, model, config_list, optimizer=None):
        self.model, self.config_list, self.optimizer = model, config_list, optimizer


class ToyModel:
    pass


class ToyPlugin:
    @hookimpl
    def compressor_add_backends(self, registry):
        registry.add_backend("toy", framework="json", description="toy models")

    @hookimpl
    def compressor_add_algorithms(self, registry):
        registry.register("toy", "ToyPruner", ToyPruner, kind="pruner")
        registry.register("torch", "ToyTorchPruner", "tests.core.test_plugins:ToyPruner", kind="pruner")

    @hookimpl
    def compressor_claim_model(self, model):
        return "toy" if isinstance(model, ToyModel) else None


@pytest.fixture
def toy_plugin():
    plugin = ToyPlugin()
    compressor.register_plugin(plugin, name="toy")
    yield plugin
    R.unregister_plugin(plugin)


def test_builtin_backends_are_declared():
    reg = R.registry()
    assert set(reg.backends) >= {"torch", "tf"}
    assert reg.backends["torch"].framework == "torch" and reg.backends["tf"].framework == "tensorflow"
    assert "Conv2d" in reg.backends["torch"].default_types and "Dense" in reg.backends["tf"].default_types


def test_register_plugin_and_dispatch_by_name(toy_plugin):
    avail = compressor.available()
    assert avail["toy"] == {"pruners": ["ToyPruner"], "quantizers": []}
    model = ToyModel()
    algo = compressor.ToyPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], "opt")
    assert isinstance(algo, ToyPruner) and algo.model is model and algo.optimizer == "opt"
    assert R.backend_for(model) == "toy"
    assert "ToyPruner" in dir(compressor)


def test_unknown_model_lists_installed_backends():
    with pytest.raises(compressor.ModelError, match=r"no installed backend handles a model of type builtins.dict"):
        R.backend_for({})


def test_unknown_algorithm_did_you_mean(toy_plugin):
    with pytest.raises(compressor.ConfigError, match=r"no algorithm 'ToyPrunr' for backend 'toy' \(did you mean 'ToyPruner'\?\)"):
        R.registry().get("toy", "ToyPrunr")
    with pytest.raises(AttributeError):
        compressor.NoSuchPruner  # noqa: B018


def test_missing_framework_is_a_clear_error():
    reg = Registry()
    reg.add_backend("ghost", framework="no_such_framework_xyz")
    reg.register("ghost", "GhostPruner", "nowhere:GhostPruner")
    assert reg.available() == {}
    with pytest.raises(compressor.BackendNotAvailable, match=r"needs 'no_such_framework_xyz'.*compressor\[ghost\]"):
        reg.get("ghost", "GhostPruner")


def test_registry_validates_registrations():
    reg = Registry()
    with pytest.raises(ValueError, match="kind"):
        reg.register("x", "A", object, kind="distiller")
    with pytest.raises(ValueError, match="identifier"):
        reg.register("x", "not a name", object)


def test_third_party_plugin_through_entry_point_group(tmp_path):
    """Install a plugin the way pip would (a dist-info with entry_points.txt on sys.path) and use it by
    name in a fresh interpreter."""
    pkg = tmp_path / "acme_prune"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        from compressor.core.hookspecs import hookimpl

        class AcmeModel: ...

        class AcmePruner:
            def __init__(self, model, config_list, optimizer=None):
                self.config_list = config_list

        @hookimpl
        def compressor_add_backends(registry):
            registry.add_backend("acme", framework="acme_prune", description="acme")

        @hookimpl
        def compressor_add_algorithms(registry):
            registry.register("acme", "AcmePruner", "acme_prune:AcmePruner")

        @hookimpl
        def compressor_claim_model(model):
            return "acme" if isinstance(model, AcmeModel) else None
    """))
    dist = tmp_path / "acme_prune-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-prune\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[compressor]\nacme = acme_prune\n")
    code = textwrap.dedent("""
        import sys, compressor, acme_prune
        print(compressor.available()["acme"])
        p = compressor.AcmePruner(acme_prune.AcmeModel(), [{"sparsity": 0.5, "op_types": ["default"]}])
        print(type(p).__name__, p.config_list[0]["sparsity"])
        print("torch" in sys.modules, "tensorflow" in sys.modules)
    """)
    env = {"PYTHONPATH": f"{tmp_path}:{R.__file__.rsplit('/compressor/', 1)[0]}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["{'pruners': ['AcmePruner'], 'quantizers': []}", "AcmePruner 0.5",
                                       "False False"]
