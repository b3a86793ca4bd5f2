"""Top-level dispatch: ``compressor.<Algorithm>(model, ...)`` picks the backend through the claim hook."""

import pytest

import compressor
from compressor.core import registry as R
from compressor.core.algorithms import resolve_algorithm_name
from compressor.core.hookspecs import hookimpl


class BoxModel:
    """A model of the toy framework."""


class BoxPruner:
    config_keys = ("sensitivity",)
    required_keys = ("sensitivity",)

    def __init__(self, model, config_list, optimizer=None, **kwargs):
        self.model, self.config_list, self.optimizer, self.kwargs = model, config_list, optimizer, kwargs


class BoxPlugin:
    @hookimpl
    def compressor_add_backends(self, registry):
        registry.add_backend("box", framework="json", description="box models")

    @hookimpl
    def compressor_add_algorithms(self, registry):
        registry.register("box", "BoxPruner", BoxPruner, kind="pruner")

    @hookimpl
    def compressor_claim_model(self, model):
        return "box" if isinstance(model, BoxModel) else None


@pytest.fixture
def box():
    plugin = BoxPlugin()
    compressor.register_plugin(plugin, name="box")
    yield plugin
    R.unregister_plugin(plugin)


def test_dispatch_builds_the_claiming_backends_class(box):
    model = BoxModel()
    algo = compressor.BoxPruner(model, [{"sensitivity": 1.0, "op_types": ["default"]}], "opt", extra=3)
    assert type(algo) is BoxPruner
    assert algo.model is model and algo.optimizer == "opt" and algo.kwargs == {"extra": 3}
    assert compressor.BoxPruner is compressor.BoxPruner  # one dispatcher per name
    assert compressor.BoxPruner.__name__ == "BoxPruner" and "BoxPruner" in dir(compressor)
    from compressor import BoxPruner as imported

    assert imported is compressor.BoxPruner


def test_available_lists_plugin_algorithms_per_installed_backend(box):
    assert compressor.available()["box"] == {"pruners": ["BoxPruner"], "quantizers": []}
    assert compressor.backends()["box"] is True


def test_config_list_first_is_a_clear_error(box):
    with pytest.raises(compressor.ModelError, match=r"takes the model first, got a config_list; the seed-004 style "
                                                     r"is compressor.torchCompressor.BoxPruner\(config_list\)\(model\)"):
        compressor.BoxPruner([{"sensitivity": 1.0, "op_types": ["default"]}])


def test_model_of_no_known_framework_lists_installed_backends(box):
    installed = sorted(b for b, ok in compressor.backends().items() if ok)
    with pytest.raises(compressor.ModelError) as info:
        compressor.BoxPruner(object(), [{"sensitivity": 1.0, "op_types": ["default"]}])
    msg = str(info.value)
    assert "no installed backend handles a model of type builtins.object" in msg
    for b in installed:
        assert repr(b) in msg


def test_unknown_names_and_private_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchPruner'"):
        compressor.NoSuchPruner  # noqa: B018
    with pytest.raises(AttributeError):
        compressor._private  # noqa: B018


def test_submodules_load_on_access():
    assert compressor.report.__name__ == "compressor.app.report"  # the old paths are the app's modules
    assert compressor.cli.__name__ == "compressor.app.cli"
    assert compressor.app.__name__ == "compressor.app"


@pytest.mark.parametrize(("name", "expected"), [
    ("tfAGPruner", ("tf", "AGPPruner")),
    ("torchLevelPruner", ("torch", "LevelPruner")),
    ("QATquantizer", (None, "QAT_Quantizer")),
    ("AGPruner", (None, "AGPPruner")),
    ("DoReFaQuantizer", (None, "DoReFaQuantizer")),
    ("tfidf", (None, "tfidf")),  # a prefix only counts before an upper-case letter
    ("torchy", (None, "torchy")),
])
def test_resolve_seed004_names(name, expected):
    assert resolve_algorithm_name(name) == expected
