"""Training-loop integrations drive a compressor exactly as a plain loop does: transformers.Trainer,
Lightning and the plain-loop helper (compressor.torch.callbacks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compressor import ConfigError
from compressor.torch import AGPPruner, QAT_Quantizer
from compressor.torch.callbacks import LoopDriver, compression_epochs, unwrap_optimizer

pytestmark = pytest.mark.torch

EPOCHS, BATCHES, BATCH = 4, 3, 4
AGP = [{"initial_sparsity": 0.0, "final_sparsity": 0.75, "start_epoch": 0, "end_epoch": 4, "frequency": 1,
        "op_types": ["Linear"]}]
# floor(128 * s) for AGP's cubic ramp 0 -> 0.75 (NNI: updates at epochs 0..3 of end_epoch 4): s = 0, 0.5278, 0.7222, 0.75
AGP_ZEROS = [0, 67, 92, 96]
QAT = [{"quant_types": ["weight"], "quant_bits": 8, "quant_start_step": 5, "op_types": ["Linear"]}]


class Net(nn.Module):
    """A Linear(16, 8) whose forward takes a batch dict and returns ``{"loss", "logits"}`` (what Trainer wants)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.fc(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def data(n: int = BATCHES * BATCH) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(16, generator=g), "labels": torch.randint(0, 8, (), generator=g)} for _ in range(n)]


def zeros(model: nn.Module) -> int:
    return int((model.fc.weight == 0).sum())


def probe(compressor, model: nn.Module) -> tuple:
    """What the schedule decides, read after an optimizer step: pruned weights, and for quantizers the
    compressor's step count and whether fake quantization is on."""
    if isinstance(compressor, QAT_Quantizer):
        return compressor.steps, bool(compressor.get_modules_wrapper()[0].quant_active)
    return (zeros(model),)


def plain_loop(make, accumulate: int = 1) -> list[tuple]:
    """The reference: the documented plain loop (optimizer passed in, update_epoch at each epoch)."""
    torch.manual_seed(0)
    model = Net()
    compressor = make(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    compressor.hook_optimizer(optimizer)
    seen, batches = [], data()
    for epoch in range(EPOCHS):
        compressor.update_epoch(epoch)
        for i in range(0, len(batches), BATCH):
            b = {k: torch.stack([d[k] for d in batches[i:i + BATCH]]) for k in ("x", "labels")}
            model(**b)["loss"].backward()
            if (i // BATCH + 1) % accumulate == 0:
                optimizer.step()
                optimizer.zero_grad()
                seen.append(probe(compressor, model))
    return seen


def agp(model):
    pruner = AGPPruner(model, AGP)
    pruner.compress()
    return pruner


def qat(model):
    quantizer = QAT_Quantizer(model, QAT)
    quantizer.compress()
    return quantizer


def test_plain_loop_reference_is_the_agp_schedule():
    assert plain_loop(agp) == [(z,) for z in AGP_ZEROS for _ in range(BATCHES)]


def test_compression_epochs_helper_matches_plain_loop():
    torch.manual_seed(0)
    model = Net()
    pruner = agp(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen, batches = [], data()
    for epoch in compression_epochs(pruner, optimizer, EPOCHS):
        assert pruner.current_epoch == epoch
        for i in range(0, len(batches), BATCH):
            b = {k: torch.stack([d[k] for d in batches[i:i + BATCH]]) for k in ("x", "labels")}
            optimizer.zero_grad()
            model(**b)["loss"].backward()
            optimizer.step()
            seen.append(probe(pruner, model))
    assert seen == plain_loop(agp)


def test_bad_inputs_are_refused():
    with pytest.raises(ConfigError, match="expected a compressor"):
        LoopDriver(object())
    with pytest.raises(ConfigError, match="torch.optim.Optimizer"):
        unwrap_optimizer(object())


# ------------------------------------------------------------------ transformers.Trainer
def test_masks_hold_under_a_fused_optimizer():
    """Fused AdamW (the Trainer's default) moves weights without bumping their version counters: the hook
    still re-masks every step."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    from compressor.torch import LevelPruner

    LevelPruner(model, [{"sparsity": 0.75, "op_types": ["Linear"]}], optimizer).compress()
    for _ in range(3):
        optimizer.zero_grad()
        model(**{k: torch.stack([d[k] for d in data(4)]) for k in ("x", "labels")})["loss"].backward()
        optimizer.step()
        assert zeros(model) == 96


def run_trainer(make, tmp_path, accumulate: int = 1, optim: str = "sgd") -> list[tuple]:
    transformers = pytest.importorskip("transformers")
    from compressor.torch.trainer_callback import CompressionCallback

    torch.manual_seed(0)
    model = Net()
    compressor = make(model)  # no optimizer: the Trainer creates it
    seen: list[tuple] = []

    class Probe(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(probe(compressor, model))

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS,
        gradient_accumulation_steps=accumulate, learning_rate=0.01, optim=optim, report_to="none",
        save_strategy="no", logging_strategy="no", eval_strategy="no", use_cpu=True, disable_tqdm=True,
        remove_unused_columns=False, lr_scheduler_type="constant", seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data(),
                                   callbacks=[CompressionCallback(compressor), Probe()])
    trainer.train()
    return seen


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch_fused"])
def test_trainer_runs_agp_schedule_of_plain_loop(tmp_path, optim):
    assert run_trainer(agp, tmp_path, optim=optim) == plain_loop(agp)


def test_trainer_steps_qat_once_per_optimizer_update(tmp_path):
    # 3 batches per epoch, accumulating 3: one optimizer update per epoch; fake quant starts at update 5
    expected = plain_loop(qat, accumulate=3)
    assert expected == [(1, False), (2, False), (3, False), (4, False)]
    assert run_trainer(qat, tmp_path, accumulate=3) == expected
    assert run_trainer(qat, tmp_path) == plain_loop(qat)  # 12 updates: quantization on from the 5th


# ------------------------------------------------------------------ Lightning
def test_lightning_runs_agp_schedule_of_plain_loop():
    lightning = pytest.importorskip("lightning")
    from compressor.torch.lightning_callback import CompressionCallback

    torch.manual_seed(0)
    net = Net()
    pruner = agp(net)
    seen: list[tuple] = []

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Probe(lightning.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(probe(pruner, net))

    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH)
    trainer = lightning.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[CompressionCallback(pruner), Probe()])
    trainer.fit(Module(), loader)
    assert seen == plain_loop(agp)
    with pytest.raises(ConfigError, match="optimizer_index=1"):
        lightning.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[CompressionCallback(pruner, optimizer_index=1)]).fit(Module(), loader)
