"""PyTorch: N:M pruning (LevelPruner / AGPPruner with ``sparse_pattern``) and the compressed model file
(``export_model(..., compressed_path=...)``, ``load_compressed``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import compressor
from compressor.core.errors import CompressedFileError, ConfigError
from compressor.core.ops import NumpyOps
from compressor.core.pruning import nm_mask
from compressor.torch import (
    AGPPruner,
    FPGMPruner,
    LevelPruner,
    SlimPruner,
    load_compressed,
)


def net(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 16),
                          nn.ReLU(), nn.Linear(16, 6))
    nn.init.uniform_(model[1].weight, 0.5, 1.5)  # distinct BN scales (slimming ranks them)
    return model


def two_of_four(mask):
    g = np.moveaxis(mask.cpu().numpy(), 1, -1).reshape(-1, 4)
    return bool((g.sum(axis=1) == 2).all())


def train_steps(model, opt, n=3):
    x, y = torch.randn(8, 4, 6, 6), torch.randint(0, 6, (8,))
    for _ in range(n):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_level_two_of_four_masks_equal_core_and_survive_training():
    model = net()
    weights = {"0": model[0].weight.detach().numpy().copy(), "4": model[4].weight.detach().numpy().copy()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pruner = LevelPruner(model, [{"sparse_pattern": "2:4", "op_types": ["Conv2d", "Linear"]},
                                 {"exclude": True, "op_names": ["6"]}], opt)
    pruner.compress()
    for name, w in weights.items():
        np.testing.assert_array_equal(model.get_submodule(name).weight_mask.numpy(), nm_mask(NumpyOps(), w, 2, 4))
    train_steps(model, opt)
    for name in weights:
        layer = model.get_submodule(name)
        assert two_of_four(layer.weight_mask)
        assert two_of_four(layer.weight.detach() != 0)  # pruned weights stay zero through SGD with momentum


@pytest.mark.parametrize("config, match", [
    ([{"sparse_pattern": "2:4", "op_types": ["Linear"]}], r"layer '6' \(Linear\) has input dimension 18 "),
    ([{"sparse_pattern": "2:3", "op_names": ["4"]}], "input dimension 128.*M=3"),
    ([{"sparse_pattern": "2:4", "op_types": ["BatchNorm2d"]}], r"'1' \(BatchNorm2d\) cannot take sparse_pattern"),
    ([{"sparse_pattern": "4:4", "op_names": ["4"]}], "1 <= N < M"),
    ([{"sparse_pattern": "2:4", "sparsity": 0.7, "op_names": ["4"]}], "contradicts"),
    ([{"op_names": ["4"]}], "without 'sparse_pattern'.*needs key\\(s\\) \\['sparsity'\\]"),
])
def test_bad_sparse_pattern_is_refused_before_the_model_changes(config, match):
    model = net()
    model.get_submodule("6").weight.data = torch.randn(6, 18)  # input dim 18: 2:4 does not fit
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=match):
        LevelPruner(model, config)
    assert list(model.state_dict()) == list(before)  # not wrapped
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_agp_ramps_to_exact_two_of_four():
    model = net()
    cfg = [{"sparse_pattern": "2:4", "op_names": ["4"], "start_epoch": 0, "end_epoch": 3, "frequency": 1}]
    pruner = AGPPruner(model, cfg)
    pruner.compress()
    pruned = []
    for epoch in range(5):
        pruner.update_epoch(epoch)
        m = model.get_submodule("4").weight_mask
        pruned.append(int((~m).sum()))
        groups = np.moveaxis(m.numpy(), 1, -1).reshape(-1, 4)
        assert (groups.sum(axis=1) >= 2).all()  # never more than M - N zeros in a group on the way
    assert pruned == sorted(pruned) and pruned[0] == 0 and pruned[-1] == 16 * 128 // 2
    assert two_of_four(model.get_submodule("4").weight_mask)
    with pytest.raises(ConfigError, match="pruning_algorithm='level'"):
        AGPPruner(net(), cfg, pruning_algorithm="l1")


def _bits_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        x = a[k].numpy() if torch.is_tensor(a[k]) else a[k]
        assert x.dtype == b[k].dtype and x.shape == b[k].shape and x.tobytes() == b[k].tobytes(), k


@pytest.mark.parametrize("make", [
    lambda m: LevelPruner(m, [{"sparsity": 0.8, "op_types": ["default"]}]),
    lambda m: LevelPruner(m, [{"sparse_pattern": "2:4", "op_names": ["0", "4"]}]),
    lambda m: FPGMPruner(m, [{"sparsity": 0.5, "op_types": ["Conv2d"]}]),
    lambda m: AGPPruner(m, [{"final_sparsity": 0.6, "op_types": ["default"], "end_epoch": 1}]),
    lambda m: SlimPruner(m, [{"sparsity": 0.5, "op_types": ["BatchNorm2d"]}]),
], ids=["level", "level-2:4", "fpgm", "agp", "slim"])
def test_compressed_export_is_the_state_dict_bit_for_bit(tmp_path, make):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pruner = make(model)
    pruner.compress()
    pruner.hook_optimizer(opt)
    train_steps(model, opt, 2)
    pruner.update_epoch(1)
    pruner.export_model(tmp_path / "m.pt", compressed_path=tmp_path / "m.cmpk")
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    unpacked = compressor.unpack(tmp_path / "m.cmpk")
    _bits_equal(state, unpacked)  # num_batches_tracked (int64) included
    assert (tmp_path / "m.cmpk").stat().st_size < (tmp_path / "m.pt").stat().st_size
    fresh = load_compressed(net(seed=1), tmp_path / "m.cmpk")
    _bits_equal(fresh.state_dict(), {k: v.numpy() for k, v in state.items()})  # 0-d buffers stay 0-d
    x = torch.randn(2, 4, 6, 6)
    reference = net(seed=2)
    reference.load_state_dict(state)
    fresh.eval()
    reference.eval()
    assert torch.equal(fresh(x), reference(x))


def test_bad_file_or_wrong_model_leaves_the_model_untouched(tmp_path):
    model = net()
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    pruner.compress()
    pruner.export_model(tmp_path / "m.pt", compressed_path=tmp_path / "m.cmpk")
    data = (tmp_path / "m.cmpk").read_bytes()
    (tmp_path / "cut.cmpk").write_bytes(data[: len(data) // 2])
    target = net(seed=5)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CompressedFileError, match="truncated"):
        load_compressed(target, tmp_path / "cut.cmpk")
    other = nn.Sequential(nn.Conv2d(4, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 16),
                          nn.ReLU(), nn.Linear(16, 7))  # one layer differs: every other key fits
    other_before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CompressedFileError, match=r"'6.weight' has shape \(6, 16\)"):
        load_compressed(other, tmp_path / "m.cmpk")
    with pytest.raises(CompressedFileError, match="missing keys"):
        load_compressed(nn.Sequential(nn.Linear(2, 2)), tmp_path / "m.cmpk")
    for m, ref in ((target, before), (other, other_before)):
        assert all(torch.equal(v, ref[k]) for k, v in m.state_dict().items())
    assert isinstance(CompressedFileError("x"), ValueError)


def test_cli_pack_unpack_torch_state_dict(tmp_path, capsys):
    from compressor.app.cli import main

    model = net()
    LevelPruner(model, [{"sparsity": 0.9, "op_types": ["default"]}]).compress()
    state = {k: v.clone() for k, v in net().state_dict().items()}
    for k, v in compressor.torch.pruning.export.unwrapped_state_dict(model).items():
        state[k] = v
    torch.save(state, tmp_path / "m.pt")
    assert main(["pack", str(tmp_path / "m.pt"), str(tmp_path / "m.cmpk"), "--compare"]) == 0
    out = capsys.readouterr().out
    assert "smaller" in out and "file size by codec: auto" in out and "huffman" in out
    assert main(["unpack", str(tmp_path / "m.cmpk"), str(tmp_path / "back.pt")]) == 0
    assert main(["unpack", str(tmp_path / "m.cmpk"), str(tmp_path / "back.npz")]) == 0
    _bits_equal(state, {k: v.numpy() for k, v in torch.load(tmp_path / "back.pt", weights_only=True).items()})
    with np.load(tmp_path / "back.npz") as z:
        _bits_equal(state, {k: z[k] for k in z.files})
    (tmp_path / "bad.cmpk").write_bytes(b"CMPK" + b"\0" * 30)
    assert main(["unpack", str(tmp_path / "bad.cmpk"), str(tmp_path / "x.pt")]) == 2
    assert "compressor: error:" in capsys.readouterr().err and not (tmp_path / "x.pt").exists()
    assert main(["unpack", str(tmp_path / "m.cmpk"), str(tmp_path / "x.keras")]) == 2
    assert "--model" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ weight sharing
def sparse_mlp(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight[model[0].weight.abs() < 0.1] = 0
    return model


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                      lambda p: torch.optim.Adam(p, lr=1e-2)], ids=["sgd", "adam"])
def test_weight_sharing_sums_member_gradients_and_keeps_clusters_tied(make_opt):
    from compressor.torch import WeightSharingQuantizer

    model = sparse_mlp()
    pruned = (model[0].weight == 0).clone()
    opt = make_opt(model.parameters())
    sharer = WeightSharingQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 3, "op_types": ["Linear"]}], opt)
    model = sharer.compress()
    layer = model[0]
    assert len(torch.unique(layer.weight[~pruned])) <= 8 and bool((layer.weight[pruned] == 0).all())
    x, y = torch.randn(32, 20), torch.randint(0, 4, (32,))
    # the gradient each weight gets is its cluster's summed plain gradient
    plain = sparse_mlp()
    plain.load_state_dict({k.replace(".module", ""): v for k, v in model.state_dict().items() if "ws_" not in k})
    nn.functional.cross_entropy(plain(x), y).backward()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    a, g, g0 = layer.ws_assignment, layer.weight.grad, plain[0].weight.grad
    k = layer.ws_centroids.numel()
    for c in range(k):
        torch.testing.assert_close(g[a == c], g0[a == c].sum().expand(int((a == c).sum())))
    assert bool((g[a == k] == 0).all())
    for _ in range(4):
        opt.step()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
    w = layer.weight.detach()
    for c in range(k):  # members moved together: still one value per cluster, bit for bit
        assert len(torch.unique(w[a == c])) == 1
    assert bool((w[pruned] == 0).all())


def test_weight_sharing_export_stores_a_codebook(tmp_path):
    from compressor.torch import WeightSharingQuantizer

    model = sparse_mlp()
    sharer = WeightSharingQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 2, "op_types": ["Linear"]}])
    sharer.compress()
    books = sharer.export_model(tmp_path / "m.pt", compressed_path=tmp_path / "m.cmpk")
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    _bits_equal(state, compressor.unpack(tmp_path / "m.cmpk"))
    assert set(books) == {"0", "2"} and all(v.size <= 4 for v in books.values())
    assert set(torch.unique(state["0.weight"]).tolist()) <= {0.0, *books["0"].tolist()}
    layouts = {t["name"]: t["layout"] for t in compressor.core.cmpk.read_info(tmp_path / "m.cmpk")["tensors"]}
    assert layouts["0.weight"][1] == "s" and layouts["2.weight"][1] == "s"
    with pytest.raises(ConfigError, match="1..16"):
        WeightSharingQuantizer(sparse_mlp(), [{"quant_types": ["weight"], "quant_bits": 17, "op_types": ["Linear"]}])
    with pytest.raises(ConfigError):
        WeightSharingQuantizer(sparse_mlp(), [{"quant_types": ["input"], "quant_bits": 4, "op_types": ["Linear"]}])


# ------------------------------------------------------------------------------------------ 2:4 on CUDA
def test_weight_sharing_export_to_one_file_twice_names_the_arguments(tmp_path):
    from compressor.torch import WeightSharingQuantizer

    model = sparse_mlp()
    sharer = WeightSharingQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 2, "op_types": ["Linear"]}])
    sharer.compress()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (tmp_path / "m.pt").write_bytes(b"old")
    with pytest.raises(ConfigError, match=r"model_path and compressed_path are the same file .*m\.pt"):
        sharer.export_model(tmp_path / "m.pt", compressed_path=tmp_path / "m.pt")
    assert (tmp_path / "m.pt").read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
    after = model.state_dict()  # refused before tie() moved any weight to its centroid
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_to_semi_structured_checks_before_converting():
    from compressor.torch import to_semi_structured
    from compressor.torch.semi_structured import is_two_of_four

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    pruner = LevelPruner(model, [{"sparse_pattern": "2:4", "op_names": ["0"]}])
    pruner.compress()
    assert is_two_of_four(model[0].weight) and not is_two_of_four(model[2].weight)
    if not torch.cuda.is_available():
        with pytest.raises(compressor.ModelError, match="CUDA"):
            to_semi_structured(pruner)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_semi_structured_outputs_equal_the_masked_model_cuda():
    from compressor.torch import to_semi_structured

    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("semi-structured sparsity needs compute capability >= 8.0")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64)).cuda()
    pruner = LevelPruner(model, [{"sparse_pattern": "2:4", "op_types": ["Linear"]}])
    pruner.compress()
    masked = compressor.torch.pruning.export.unwrapped_model(model).half().eval()
    sparse = to_semi_structured(pruner)
    assert type(sparse[0].weight).__name__.startswith("SparseSemiStructured")
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), masked(x), rtol=1e-2, atol=1e-2)


def test_exported_pruned_weights_are_positive_zeros(tmp_path):
    """Masking by multiplication leaves -0.0 where a negative weight was pruned; the export writes +0.0, so
    the compressed file does not have to keep 1 sign bit per pruned weight."""
    model = net()
    pruner = LevelPruner(model, [{"sparsity": 0.9, "op_types": ["default"]}])
    pruner.compress()
    pruner.export_model(tmp_path / "m.pt", compressed_path=tmp_path / "m.cmpk")
    w = torch.load(tmp_path / "m.pt", weights_only=True)["4.weight"]
    assert not bool(torch.signbit(w[w == 0]).any())
    layout = {t["name"]: t for t in compressor.core.cmpk.read_info(tmp_path / "m.cmpk")["tensors"]}["4.weight"]
    assert layout["layout"][0] in "mrMR" and layout["bytes"] < 0.15 * 16 * 128 * 4
