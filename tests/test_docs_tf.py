"""README snippets marked ``<!-- doctest: tf -->`` (see tests/test_docs.py)."""

import keras
import pytest

from tests.test_docs import params, run_block


@pytest.mark.parametrize(("line", "code"), params("tf"))
def test_readme_tf_block(line, code, tmp_path, monkeypatch):
    keras.utils.set_random_seed(0)
    run_block(line, code, tmp_path, monkeypatch)
