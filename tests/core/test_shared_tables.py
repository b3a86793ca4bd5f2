"""Tables both backends resolve from one place: the pruning exports (core) and the seed-004 built-in names."""

import pytest

from compressor.core.algorithms import PRUNERS, PRUNING_EXPORTS, export_table


def test_table_names_every_builtin_pruner_once():
    names = [n for ns in PRUNING_EXPORTS.values() for n in ns]
    assert len(names) == len(set(names)) == 26
    # every built-in pruner, the one-shot ones too (pruning/oneshot.py on both backends), is in the shared table
    assert set(PRUNERS) - set(names) == set()
    assert PRUNING_EXPORTS["oneshot"] == ("SparseGPTPruner", "WandaPruner")


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


def test_prototype_builtins_are_defined_once_for_any_shim():
    import types

    from compressor.compat.prototype import PrototypePruner, PrototypeQuantizer, define_builtins

    ns = types.ModuleType("fake.modern")
    base_p = type("FakePruner", (PrototypePruner,), {"_namespace": ns})
    base_q = type("FakeQuantizer", (PrototypeQuantizer,), {"_namespace": ns})
    level, agp, sens, qat, dorefa = define_builtins("fake.shim", base_p, base_q)
    assert [c.__name__ for c in (level, agp, sens, qat, dorefa)] == [
        "LevelPruner", "AGPruner", "SensitivityPruner", "QATquantizer", "DoReFaQuantizer"]
    assert [c._modern for c in (level, agp, sens, qat, dorefa)] == [
        "LevelPruner", "AGPPruner", "SensitivityPruner", "QAT_Quantizer", "DoReFaQuantizer"]
    assert [c.__bases__ for c in (level, agp, sens, qat, dorefa)] == [(base_p,)] * 3 + [(base_q,)] * 2
    assert level.__module__ == "fake.shim" and level.__qualname__ == "LevelPruner"
    assert level.__doc__ == "Magnitude pruning to ``sparsity`` per layer (modern :class:`fake.modern.LevelPruner`)."
    assert sens._legacy_renames == {"sparsity": "sensitivity"} and qat._legacy_renames == {"q_bits": "quant_bits"}
