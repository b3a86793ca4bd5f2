"""compressor.torch imports torch but never tensorflow."""

from tests.core.test_imports import loaded_after


def test_torch_backend_does_not_import_tensorflow():
    assert loaded_after("import compressor.torch") == {"torch"}
