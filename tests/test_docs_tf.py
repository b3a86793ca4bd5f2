"""README and docs/ snippets marked ``<!-- doctest: tf -->`` (see tests/test_docs.py)."""

import keras
import pytest

from tests.test_docs import check_api_page, params, run_block


@pytest.mark.parametrize(("path", "line", "code"), params("tf"))
def test_readme_tf_block(path, line, code, tmp_path, monkeypatch):
    keras.utils.set_random_seed(0)
    run_block(path, line, code, tmp_path, monkeypatch)


def test_api_reference_covers_compressor_tf():
    import compressor.tf

    check_api_page(compressor.tf, "tf")
