"""compressor.tf imports tensorflow but never torch."""

from tests.core.test_imports import loaded_after


def test_tf_backend_does_not_import_torch():
    loaded = loaded_after("import compressor.tf")
    assert "tensorflow" in loaded and "torch" not in loaded


def test_demo_tf_harness_does_not_import_torch():
    loaded = loaded_after("from compressor.demo import get_harness; get_harness('tf')")
    assert "tensorflow" in loaded and "torch" not in loaded
    loaded = loaded_after("from compressor.demo import TfHarness")
    assert "tensorflow" in loaded and "torch" not in loaded
