"""The one-shot methods' configuration: their config keys (:data:`ONESHOT_KEYS`), a layer's weight grid
resolved from its config entry (:func:`quant_spec_of`, once per layer), and the dtype policy of the block passes
(:func:`forward_in_float64`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import KeySpec, _bool, _choice, _fraction, _int_at_least, _is_int
from ..errors import ConfigError
from .codes import QuantSpec
from .sparse import MASK_SCOPES


def _group_size(v: Any) -> int | None:
    if v is None or (_is_int(v) and (v == -1 or v >= 1)):
        return None if v is None or v == -1 else int(v)
    raise ValueError


def _search_samples(v: Any) -> int | None:
    if v is None or (_is_int(v) and v >= 1):
        return None if v is None else int(v)
    raise ValueError


def _duo_scaling(v: Any) -> bool | str:
    if isinstance(v, bool) or v == "both":
        return v
    raise ValueError


#: ``awq_search``: where AWQ's alpha is chosen (see :class:`AwqMethod`)
AWQ_SEARCHES = ("block", "layer")


#: ``search_samples`` when the config does not say (None: every calibration sequence). 16 sequences, spread over
#: the set: on the trained byte-level Llama of examples/RESULTS.md (128 calibration windows) the same perplexity as
#: all 128 over 3 seeds (mean 8.6723 vs 8.6720 with clipping) at a quarter of the time and an eighth of the search's
#: recorded inputs; ``search_samples: None`` is the reference's full search
AWQ_SEARCH_SAMPLES: int | None = 16


#: last name components of the layers AWQ's clipping search leaves alone (attention query / key projections,
#: as AutoAWQ's name rule; names starting with ``q_`` / ``k_`` or holding ``qkv`` too)
AWQ_CLIP_SKIP = frozenset({"q", "k", "query", "key", "c_attn", "query_key_value", "wq", "wk"})


#: ``quant_range``: the symmetric code range (``narrow``: the project's convention; ``full``: compressed-tensors')
QUANT_RANGES = ("narrow", "full")


#: ``calibrate(forward_dtype=...)``: the dtype the blocks run in while their layers' input statistics are recorded
#: and their (compressed) outputs handed to the next block
FORWARD_DTYPES = ("auto", "float64", "model")


def forward_in_float64(value: Any, what: str, on_cpu: bool) -> bool:
    """Whether ``calibrate(forward_dtype=value)`` runs those block passes in float64 (the weights and inputs
    widened exactly, the block's own casts kept: e.g. Hugging Face's RMSNorm and eager softmax still compute in
    float32): ``'float64'`` always, ``'model'`` (the default) never (the model's own dtype, as llmcompressor:
    half the memory of the widened passes, which a streamed run needs, and their cost), ``'auto'`` on CPU only.
    Why: two frameworks' float32 forwards differ in the last bits (their GEMM, softmax
    and norm kernels sum in other orders); GPTQ's rounding and SparseGPT's N:M / threshold choices flip near
    ties, the error feedback carries each flip along its row, and the same weights and data gave perplexities
    up to 5.6e-3 apart on PyTorch and Keras (examples/RESULTS.md); in float64 they agree to 1e-8. On a CPU the
    cost is the float64 GEMMs of those passes (AWQ's search and the rest keep the model's dtype); on an
    accelerator float64 is slow. Hence the model's dtype by default, and ``'float64'`` where the two frameworks
    must agree."""
    if not isinstance(value, str) or value not in FORWARD_DTYPES:
        raise ConfigError(f"{what}: forward_dtype must be one of {list(FORWARD_DTYPES)} ('model', the default: "
                          f"the model's own dtype; 'float64'; 'auto': float64 on CPU, the model's dtype on an "
                          f"accelerator), "
                          f"got {value!r}")
    return value == "float64" or (value == "auto" and on_cpu)


#: the config keys of the one-shot methods (each compressor lists the ones it takes in ``config_keys``)
ONESHOT_KEYS: dict[str, KeySpec] = {s.name: s for s in [
    KeySpec("group_size", _group_size, "a positive int (input columns per quantization group) or -1 / None "
                                       "(one group per output channel)"),
    KeySpec("damp", _fraction(0.0, 1.0), "a number in [0, 1): the fraction of mean(diag(H)) added to the Hessian's diagonal"),
    KeySpec("block_size", _int_at_least(1), "an int >= 1 (columns per lazy OBS update block, default 128)"),
    KeySpec("act_order", _bool, "True or False (GPTQ: sweep columns by decreasing Hessian diagonal)"),
    KeySpec("mask_scope", _choice(MASK_SCOPES), f"one of {list(MASK_SCOPES)} (SparseGPT: where the "
                                                      f"per-block pruning threshold is taken)"),
    KeySpec("n_grid", _int_at_least(1), "an int >= 1 (AWQ: points of the search grid, default 20)"),
    KeySpec("duo_scaling", _duo_scaling, "True, False or 'both' (AWQ: True (default): the identity, "
                                                         "then exponents in [0, 1] scaling by activation and weight "
                                                         "statistics; False: activation statistics only; 'both': "
                                                         "half the grid each way)"),
    KeySpec("awq_search", _choice(AWQ_SEARCHES), f"one of {list(AWQ_SEARCHES)} (AWQ: 'block' (default) searches one "
                                                 f"alpha per group of layers that read the same input, on the block's "
                                                 f"output error; 'layer': each layer alone, on its own output error)"),
    KeySpec("apply_clip", _bool, "True or False (AWQ: True (default): after the scales, search a clipping range "
                                 "per group of the scaled weight on the output error, as AutoAWQ; query / key "
                                 "projections are not clipped)"),
    KeySpec("search_samples", _search_samples, "an int >= 1 or None (AWQ, awq_search 'block': how many calibration "
                                                "sequences, spread evenly over the set, the alpha grid is scored on; "
                                                f"default {AWQ_SEARCH_SAMPLES}; None: all of them. The statistics "
                                                "always use every sequence)"),
    KeySpec("quant_range", _choice(QUANT_RANGES), f"one of {list(QUANT_RANGES)} (symmetric weight grid: 'narrow' "
                                                  f"(default) [-(2^(b-1)-1), 2^(b-1)-1], e.g. int4 [-7, 7]; 'full' "
                                                  f"[-2^(b-1), 2^(b-1)-1], e.g. int4 [-8, 7] as compressed-tensors "
                                                  f"and Keras int4)"),
]}


QUANT_SCHEMES = {"per_channel_symmetric": True, "per_tensor_symmetric": True, "symmetric": True,
                 "per_channel_affine": False, "per_tensor_affine": False, "affine": False}


def _weight_scheme(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) != {"weight"}:
            raise ValueError
        return {"weight": _weight_scheme(v["weight"])}
    if v not in QUANT_SCHEMES:
        raise ValueError
    return v


#: ``quant_scheme`` of the weight-only one-shot quantizers (listed in their ``config_keys``)
QUANT_SCHEME_KEY = KeySpec("quant_scheme", _weight_scheme, f"one of {sorted(QUANT_SCHEMES)} (weights; default "
                                                           f"'symmetric') or {{'weight': one of them}}")


#: what the one-shot compressors say about the weighted layers 'default' leaves out (embeddings, norms, ...)
ONESHOT_SKIP_HINT = ("the one-shot methods compress Linear-like layers only (Linear / HF Conv1D, Dense / EinsumDense); "
                     "the others stay as they are")


def weight_only_config(config_list: Any) -> Any:
    """Entries without ``quant_types`` quantize weights (``quant_bits: 4`` means ``{'weight': 4}``); the
    input is not modified (anything but a list is returned as is, for the validator to refuse)."""
    if not isinstance(config_list, (list, tuple)):
        return config_list
    return [{**e, "quant_types": ["weight"]} if isinstance(e, Mapping) and "quant_types" not in e else e
            for e in config_list]


def quant_spec_of(config: dict[str, Any], what: str) -> QuantSpec:
    """The weight grid of a one-shot quantizer's normalised config entry: ``quant_bits['weight']`` (2..8),
    ``quant_scheme`` (symmetric / affine; default symmetric), ``group_size`` (default: per channel),
    ``quant_range`` (symmetric codes: 'narrow' (default) or 'full'; affine codes always use all ``2^b`` values)."""
    bits = config.get("quant_bits", {}).get("weight")
    if bits is None:
        raise ConfigError(f"{what}: config entry {config.get('op_types') or config.get('op_names')} has no weight "
                          f"bits; give quant_bits: 4 (or {{'weight': 4}})")
    scheme = config.get("quant_scheme", "symmetric")
    if isinstance(scheme, dict):
        scheme = scheme.get("weight", "symmetric")
    if scheme not in QUANT_SCHEMES:
        raise ConfigError(f"{what}: quant_scheme {scheme!r} is not one of {sorted(QUANT_SCHEMES)}")
    if not 2 <= int(bits) <= 8:
        raise ConfigError(f"{what}: weight-only one-shot quantization takes quant_bits 2..8, got {bits}")
    qrange = config.get("quant_range", "narrow")
    if qrange not in QUANT_RANGES:
        raise ConfigError(f"{what}: quant_range {qrange!r} is not one of {list(QUANT_RANGES)}")
    return QuantSpec(int(bits), symmetric=QUANT_SCHEMES[scheme], group_size=config.get("group_size"),
                         narrow=qrange == "narrow")

