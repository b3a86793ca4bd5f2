"""compressor.tf imports tensorflow but never torch."""

from tests.core.test_imports import loaded_after


def test_tf_backend_does_not_import_torch():
    loaded = loaded_after("import compressor.tf")
    assert "tensorflow" in loaded and "torch" not in loaded
