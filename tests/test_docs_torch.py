"""README and docs/ snippets marked ``<!-- doctest: torch -->`` (see tests/test_docs.py)."""

import pytest
import torch

from tests.test_docs import check_api_page, params, run_block


@pytest.mark.parametrize(("path", "line", "code"), params("torch"))
def test_readme_torch_block(path, line, code, tmp_path, monkeypatch):
    torch.manual_seed(0)
    run_block(path, line, code, tmp_path, monkeypatch)


def test_api_reference_covers_compressor_torch():
    import compressor.torch

    check_api_page(compressor.torch, "torch")
