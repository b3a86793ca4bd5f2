"""The Hugging Face family matrix (issue 43): every model family transformers builds here without downloads (tiny
random configs) x every one-shot method, each checked end to end on one whole calibration batch:

* pruners: the exact count per layer (50 %: ``floor(n / 2)`` zeros, Wanda half of every output row; 2:4: two zeros
  in every 4 consecutive inputs), and exactly the masked weights are zero;
* quantizers: every layer's codes are on the grid (integers in ``[-7, 7]``) and dequantize to its weight;
* the ``export_model(hf_path=DIR)`` checkpoint reloads with compressor's own reader
  (:func:`~compressor.core.compressed_tensors.load_compressed_tensors`) and with ``from_pretrained`` (the model's
  own class) to the compressed model's logits within 1e-5 relative, in float32.

The combinations that fail are in :data:`XFAIL` with the reason (strict: one that starts to pass fails the run,
so the list stays true). ``python -m tests.torch.test_family_matrix --table`` runs the matrix and prints the
"supported families" markdown table of docs/guides/llm.md."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from compressor.core.compressed_tensors import load_compressed_tensors
from compressor.torch import AwqQuantizer, GptqQuantizer, SparseGPTPruner, WandaPruner
from compressor.torch.quantization.lowbit import oneshot_codes
from compressor.torch.sequential import expert_banks

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

VOCAB = 64
SEQ = 8
CALIB = torch.randint(1, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))  # one batch of 4 sequences
PROBE = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
TOL = 1e-5  # relative, float32


def _common(**kw: Any) -> dict[str, Any]:
    """Llama-style config keys: hidden 32, 1 block, 4 heads (2 key / value heads), MLP 64."""
    return {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, **kw}


def _family(config: str, model: str, **kw: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        cfg = getattr(transformers, config)(**kw)
        cfg._attn_implementation = "eager"
        return getattr(transformers, model)(cfg)
    return build


FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "Llama": _family("LlamaConfig", "LlamaForCausalLM", **_common()),
    "Mistral": _family("MistralConfig", "MistralForCausalLM", **_common()),
    "Qwen2": _family("Qwen2Config", "Qwen2ForCausalLM", **_common()),
    "Qwen3": _family("Qwen3Config", "Qwen3ForCausalLM", **_common(head_dim=8)),
    "Phi-3": _family("Phi3Config", "Phi3ForCausalLM", **_common(pad_token_id=0)),
    "Gemma-2": _family("Gemma2Config", "Gemma2ForCausalLM", **_common(head_dim=8)),
    "Gemma-3": _family("Gemma3TextConfig", "Gemma3ForCausalLM", **_common(head_dim=8)),
    "GPT-2": _family("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4,
                     n_positions=64, bos_token_id=0, eos_token_id=0),
    "OPT": _family("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                   num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32),
    "Falcon": _family("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                      num_attention_heads=4),
    "GPT-NeoX": _family("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64),
    "Bloom": _family("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4),
    "BERT": _family("BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64),
    # mixture of experts (transformers 5 stores the routed experts fused, 3-D): 4 experts, 2 per token
    "Mixtral": _family("MixtralConfig", "MixtralForCausalLM", **_common(num_local_experts=4, num_experts_per_tok=2)),
    "Qwen2-MoE": _family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **_common(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        decoder_sparse_step=1)),
    "DeepSeek-V3": _family("DeepseekV3Config", "DeepseekV3ForCausalLM", **_common(
        num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_group=1, topk_group=1)),
}
#: the routed experts each MoE family's one block holds (every expert slice must come out compressed)
EXPERTS = {"Mixtral": 4, "Qwen2-MoE": 4, "DeepSeek-V3": 4}

METHODS: dict[str, tuple[type, dict[str, Any]]] = {
    "SparseGPT 50 %": (SparseGPTPruner, {"sparsity": 0.5}),
    "SparseGPT 2:4": (SparseGPTPruner, {"sparse_pattern": "2:4"}),
    "Wanda 50 %": (WandaPruner, {"sparsity": 0.5}),
    "GPTQ w4 g16": (GptqQuantizer, {"quant_bits": 4, "group_size": 16}),
    "AWQ w4 g16": (AwqQuantizer, {"quant_bits": 4, "group_size": 16}),
}

_FALCON = ("from_pretrained raises AttributeError: transformers' FalconPreTrainedModel._init_weights calls "
           "init.normal_ on FalconLinear.weight, which compressed-tensors replaced by weight_packed (the export warns; "
           "compressor.core.compressed_tensors.load_compressed_tensors reads the checkpoint)")
#: (family, method) -> (why it fails, the exception it raises): the combinations that do not pass (strict xfails)
XFAIL: dict[tuple[str, str], tuple[str, type[BaseException]]] = {
    ("Falcon", "GPTQ w4 g16"): (_FALCON, AttributeError), ("Falcon", "AWQ w4 g16"): (_FALCON, AttributeError)}


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FAMILIES[family]().eval()


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits.float()


def _check_mask(w: torch.nn.Module, cfg: dict[str, Any], wanda: bool) -> None:
    keep = w.weight_mask if type(w.module).__name__ != "Conv1D" else w.weight_mask.t()  # [out, in]
    assert torch.equal(w.weight == 0, ~w.weight_mask), f"{w.name}: zeros are not exactly the masked weights"
    _check_keep(w.name, keep, cfg, wanda)


def _check_keep(name: str, keep: torch.Tensor, cfg: dict[str, Any], wanda: bool) -> None:
    if "sparse_pattern" in cfg:
        assert (keep.reshape(keep.shape[0], -1, 4).sum(-1) == 2).all(), f"{name}: not 2:4"
    elif wanda:
        assert (keep.sum(dim=1) == keep.shape[1] // 2).all(), f"{name}: not half of every output row"
    else:
        assert int((~keep).sum()) == keep.numel() // 2, f"{name}: {int((~keep).sum())} of {keep.numel()} pruned"


def _expert_slices(model: torch.nn.Module) -> list[tuple[str, Any, torch.Tensor]]:
    """``(slice name, its one-shot result, the slice [out, in] as the bank holds it now)`` of every fused bank."""
    out = []
    for _, bank in model.named_modules():
        if not expert_banks.supported(bank):
            continue
        for name, r in sorted(expert_banks.fused_results(bank).items()):
            e, param = name.rsplit(".", 2)[-2:]
            w = getattr(bank, param)[int(e)].detach().double()
            out.append((name, r, w.t() if bank.is_transposed else w))
    return out


def _check_slice(name: str, r: Any, w: torch.Tensor, cls: type, cfg: dict[str, Any]) -> None:
    if cls in (GptqQuantizer, AwqQuantizer):
        q = r.quantized
        codes = torch.from_numpy(q.codes.astype("float64"))
        assert int(codes.abs().max()) <= 7, f"{name}: codes off the int4 grid"
        cols = torch.arange(codes.shape[1]) // q.group_size
        deq = (codes - torch.from_numpy(q.zero_point)[:, cols]) * torch.from_numpy(q.scale)[:, cols]
        if r.scales is not None:
            deq = deq / torch.from_numpy(r.scales)[None, :]
        torch.testing.assert_close(deq, w, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
    else:
        keep = torch.from_numpy(r.mask)
        assert torch.equal(w == 0, ~keep), f"{name}: zeros are not exactly the masked weights"
        _check_keep(name, keep, cfg, cls is WandaPruner)


def _check_codes(w: torch.nn.Module) -> None:
    codes = oneshot_codes(w).to(torch.float64)
    assert torch.equal(codes, codes.round()) and int(codes.abs().max()) <= 7, f"{w.name}: codes off the int4 grid"
    deq = codes * w.weight_group_scale.double()[:, torch.arange(codes.shape[1]) // 16]
    if hasattr(w, "awq_scales"):
        deq = deq / w.awq_scales.double()[None, :]
    weight = w.weight.double()
    if type(w.layer).__name__ == "Conv1D":
        weight = weight.t()
    torch.testing.assert_close(deq, weight, rtol=1e-6, atol=1e-6, msg=lambda m: f"{w.name}: {m}")


def check(family: str, method: str, folder: str) -> str | None:
    """Compress a tiny ``family`` model with ``method`` on one batch, check its layers, export it to ``folder``
    and reload it (raises AssertionError / the failure's own exception). Returns a remark for the table: how
    many of a quantizer's layers the checkpoint packs, when not all (the others are written as float weights)."""
    cls, cfg = METHODS[method]
    model = build(family)
    c = cls(model, [{**cfg, "op_types": ["default"]}]).calibrate(CALIB, progress=False)
    wrappers = list(c.get_modules_wrapper())
    slices = _expert_slices(model)
    assert len(slices) == 2 * EXPERTS.get(family, 0), f"{len(slices)} expert slices compressed"  # every one
    assert wrappers and len(c.oneshot_rows) == len(wrappers) + len(slices)
    for w in wrappers:
        if cls in (GptqQuantizer, AwqQuantizer):
            _check_codes(w)
        else:
            _check_mask(w, cfg, cls is WandaPruner)
    for name, r, w in slices:
        _check_slice(name, r, w, cls, cfg)
    ref = _logits(model)
    assert bool(torch.isfinite(ref).all())
    c.export_model(None, hf_path=folder)
    plain = build(family)  # our own reader first: the float weights by the model's names (a tied head stored once)
    tensors = load_compressed_tensors(folder)
    if slices:  # packed experts are stored per expert (transformers' layout): stacked back into the fused parameters
        tensors = expert_banks.fuse_pieces(tensors, expert_banks.checkpoint_layout(plain)[0])
    missing = plain.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False).missing_keys
    assert not [k for k in missing if "experts" in k], f"experts not read back: {missing}"
    plain.tie_weights()
    err = ((_logits(plain) - ref).abs().max() / ref.abs().max()).item()
    assert err < TOL, f"load_compressed_tensors: logits differ by {err:.3g} (relative)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = type(model).from_pretrained(folder).eval()
    err = ((_logits(reloaded) - ref).abs().max() / ref.abs().max()).item()
    assert err < TOL, f"reloaded logits differ by {err:.3g} (relative)"
    if cls not in (GptqQuantizer, AwqQuantizer):
        return None
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        qc = json.load(f).get("quantization_config") or {}
    packed = {t for g in qc.get("config_groups", {}).values() for t in g["targets"]}
    if slices:  # the experts' group targets every routed expert slice with one regular expression
        experts = {t for t in packed if t.startswith("re:")}
        layers = len(packed - experts)
        return (f"{layers} of {len(wrappers)} layers packed, experts "
                f"{'packed' if experts else 'dense'}") if layers != len(wrappers) or not experts else None
    return None if len(packed) == len(wrappers) else f"{len(packed)} of {len(wrappers)} layers packed"


CASES = [pytest.param(f, m, id=f"{f}-{m}".replace(" ", ""),
                      marks=[pytest.mark.xfail(reason=XFAIL[f, m][0], raises=XFAIL[f, m][1], strict=True)]
                      if (f, m) in XFAIL else [])
         for f in FAMILIES for m in METHODS]


@pytest.mark.parametrize(("family", "method"), CASES)
def test_family_method(tmp_path, family, method):
    check(family, method, str(tmp_path / "ckpt"))


def table() -> str:
    """Run the whole matrix and return the markdown table (family x method: pass, or why not)."""
    from tests._matrix_table import markdown_table

    def run(family: str, method: str) -> str | None:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return check(family, method, f"{tmp}/ckpt")
    return markdown_table(FAMILIES, METHODS, XFAIL, run)


if __name__ == "__main__" and "--table" in sys.argv:
    print(table())


def _forms() -> dict[str, Any]:
    """The calibration data forms users hold: a token tensor, a list of one-sequence batches, a list of batches as
    keyword dicts with an attention mask (the second sequence of each batch padded at its end)."""
    mask = torch.ones_like(CALIB)
    mask[1::2, -3:] = 0
    return {"tensor": CALIB, "rows": [CALIB[i:i + 1] for i in range(len(CALIB))],
            "dicts": [{"input_ids": CALIB[i:i + 2], "attention_mask": mask[i:i + 2]} for i in (0, 2)]}


@pytest.mark.parametrize("form", ["rows", "dicts"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_data_form_on_every_family(family, form):
    """GPTQ w4 g16 calibrated from each data form: every layer and expert slice quantized on the grid, finite
    logits; the list of single sequences gives the token tensor's codes exactly (the same tokens; one sequence
    per batch changes only the order of the Gram matrix's sums, at float64 rounding)."""
    runs = {}
    for f in ("tensor", form):
        model = build(family)
        c = GptqQuantizer(model, [{"quant_bits": 4, "group_size": 16, "op_types": ["default"]}])
        c.calibrate(_forms()[f], progress=False)
        for w in c.get_modules_wrapper():
            _check_codes(w)
        for name, r, w in _expert_slices(model):
            _check_slice(name, r, w, GptqQuantizer, {})
        assert bool(torch.isfinite(_logits(model)).all())
        runs[f] = {w.name: oneshot_codes(w) for w in c.get_modules_wrapper()}
    if form == "rows":
        differing = sum(int((runs["tensor"][k] != runs["rows"][k]).sum()) for k in runs["tensor"])
        total = sum(v.numel() for v in runs["tensor"].values())
        assert differing <= total // 1000, (differing, total)
