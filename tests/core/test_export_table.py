"""The one table of the names both backends' pruning packages export, and its resolver."""

import pytest

from compressor.core.algorithms import PRUNERS, PRUNING_EXPORTS, export_table


def test_table_names_every_builtin_pruner_once():
    names = [n for ns in PRUNING_EXPORTS.values() for n in ns]
    assert len(names) == len(set(names)) == 24
    assert set(PRUNERS) <= set(names)


def test_export_table_binds_names_and_extras():
    ns: dict = {}
    got = export_table("json", {"decoder": ("JSONDecoder",)}, ns, {"encoder": ("JSONEncoder",),
                                                                   "decoder": ("JSONDecodeError",)})
    import json.decoder
    import json.encoder
    assert got == ["JSONDecodeError", "JSONDecoder", "JSONEncoder"]
    assert ns == {"JSONDecoder": json.decoder.JSONDecoder, "JSONDecodeError": json.decoder.JSONDecodeError,
                  "JSONEncoder": json.encoder.JSONEncoder}


def test_export_table_names_a_missing_name():
    with pytest.raises(ImportError, match="json.decoder does not define 'Nope' \\(listed in the export table\\)"):
        export_table("json", {"decoder": ("Nope",)}, {})
