"""compressor.torch imports torch but never tensorflow."""

from tests.core.test_imports import loaded_after


def test_torch_backend_does_not_import_tensorflow():
    assert loaded_after("import compressor.torch") == {"torch"}


def test_demo_torch_harness_does_not_import_tensorflow():
    # the demo driver is neutral; get_harness imports only the backend asked for
    assert loaded_after("import compressor.demo") == set()
    assert loaded_after("from compressor.demo import get_harness; get_harness('torch')") == {"torch"}
    assert loaded_after("from compressor.demo import TorchHarness") == {"torch"}
