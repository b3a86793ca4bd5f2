"""The TensorFlow / Keras 3 compressor base: layer wrappers, config matching, collectors, the clock.

Contract (mirror of ``compressor.torch.compressor``; the TF pruners and quantizers build on it)
-----------------------------------------------------------------------------------------------
``Compressor(model, config_list, optimizer=None)``
    ``model`` is any Keras 3 layer/model (Sequential, Functional, subclassed; nested; built before or
    after wrapping). ``config_list`` is validated with ``core.config.normalize_config_list`` using the
    class attributes ``config_keys`` (extra keys: names of ``core.config.OPTIONAL_KEYS`` or
    ``KeySpec`` objects), ``required_keys`` and ``default_types`` (``tf_plugin.DEFAULT_TYPES``); layers
    are matched by ``core.matching.match_layers`` (``op_types`` take Keras and torch names; the last
    matching entry wins). ``validate_config(config_list)`` and ``validate_layer(layer_info, layer,
    config)`` may refuse (``ConfigError``) and ``_create_wrapper(layer, layer_info, config)`` (abstract)
    builds each wrapper. All of this happens BEFORE the model is touched: on any error the model is
    exactly as it was. A bad model is a ``ModelError``, a bad optimizer or a layer already wrapped by a
    compressor of the same ``_kind`` ('pruner' / 'quantizer') a ``ConfigError``; a quantizer may wrap a
    pruned layer (the calls chain). Recurrent and attention layers are compressed one weight matrix at a
    time: one wrapper per matrix on the same layer (:mod:`compressor.tf.slots`).
Instrumentation (in place, the same model object)
    Each selected layer gets its ``call`` intercepted on the instance, so every path that calls the
    layer (Functional graphs, Sequential, subclassed ``call``, ``fit`` / ``predict`` / a custom
    ``tf.function``) goes through ``wrapper.forward(call_fn, *args, **kwargs)`` (default:
    ``call_fn(*args, **kwargs)``; quantizers override it) and then through the activation collectors.
    The wrapper is attached to the layer as a checkpoint dependency (``layer._compressor_<kind>``), so
    its variables (masks, statistics) are saved by ``tf.train.Checkpoint(model=model)``; they are not
    Keras weights, so ``model.weights`` and ``.weights.h5`` files keep the model's own layout.
Wrappers (:class:`LayerWrapper`)
    ``.layer`` (the original Keras layer), ``.name`` (Keras layer path without the root model, e.g.
    ``block1/conv``), ``.type`` (class name), ``.config`` (the matched, normalised config entry),
    ``.layer_info``, ``.weight`` / ``.bias`` (the layer's main weight and bias variables, see
    ``compressor.tf.layout``), ``call_with_weights(call_fn, [(variable, tensor), ...], *args, **kwargs)``
    (run the layer's call reading substituted weight values, e.g. fake-quantized kernels).
State
    ``set_wrappers_attribute(name, value)``: tensors / arrays become non-trainable ``tf.Variable``s on
    the weight's device (assigning the attribute later assigns the variable, graph-safe); other values
    are plain Python attributes (copied per wrapper; read at trace time inside ``tf.function``).
Collectors
    ``add_activation_collector(fn) -> id``: ``fn(wrapper, inputs, output)`` runs on every call of every
    wrapped layer, inside the traced graph (``inputs`` is the tuple of positional inputs);
    ``remove_activation_collector(id)`` (unknown id: ``ValueError``).
Clock
    ``step()`` runs after each optimizer update: the optimizer hook (:mod:`compressor.tf.hooks`) wraps
    the Keras optimizer's ``apply`` (which ``apply_gradients`` and ``model.fit`` use) on the instance,
    in-graph, idempotently; ``update_epoch(epoch)`` is called by you or by
    :class:`compressor.tf.hooks.CompressionCallback` at each epoch begin. ``hook_optimizer(opt)`` moves
    the hook to another optimizer, ``unhook()`` removes it. ``compress() -> model``;
    ``_unwrap_model()`` / ``_wrap_model()`` remove / reinstall the instrumentation (as on torch);
    ``strip()`` unhooks and unwraps for good. ``state_dict()`` / ``load_state_dict()``: schedule position.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ..core.config import normalize_config_list
from ..core.errors import ConfigError, ModelError
from ..core.interrupts import deferred_interrupts
from ..core.matching import LayerInfo, match_layers
from ..tf_plugin import DEFAULT_TYPES
from . import hooks, layout
from .distributed import strategy_of, strategy_scope_of
from .hooks import check_optimizer

__all__ = ["Compressor", "LayerWrapper", "iter_layers", "keras_base_type", "retrace_model", "strip_model", "wrappers_of"]

_Trackable = tf.__internal__.tracking.AutoTrackable
WRAPPER_PREFIX = "_compressor_"


def iter_layers(model: keras.layers.Layer) -> list[tuple[str, keras.layers.Layer]]:
    """Every sub-layer of ``model`` once, depth first in model order, as ``(path, layer)``.

    The path joins layer names from the root's children down (``block1/conv``); input layers are skipped
    and a layer shared by several parents is listed under its first path.
    """
    out: list[tuple[str, keras.layers.Layer]] = []
    seen: set[int] = {id(model)}

    def visit(layer: keras.layers.Layer, prefix: str) -> None:
        for child in layer._flatten_layers(include_self=False, recursive=False):
            if id(child) in seen or isinstance(child, keras.layers.InputLayer):
                continue
            seen.add(id(child))
            path = f"{prefix}/{child.name}" if prefix else child.name
            out.append((path, child))
            visit(child, path)

    visit(model, "")
    return out


#: Keras layer classes whose subclasses are selected as them (their kernel layout does not depend on the class)
_SUBCLASSED_BASES = frozenset({"Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D"})


def keras_base_type(layer: keras.layers.Layer) -> tuple[str, ...]:
    """``('Dense',)`` for a subclass of ``keras.layers.Dense`` defined outside Keras (likewise EinsumDense,
    Conv1D/2D/3D): ``op_types`` (``'default'`` included) select it as that layer. Wrappers run the subclass's own
    ``call`` with the compressed kernel in place of ``kernel``, so its computation is kept. ``()`` otherwise."""
    cls = type(layer)
    if cls.__module__.split(".")[0] == "keras":
        return ()
    for base in cls.__mro__[1:]:
        if base.__module__.startswith("keras."):
            return (base.__name__,) if base.__name__ in _SUBCLASSED_BASES else ()
    return ()


def wrappers_of(layer: keras.layers.Layer) -> list[LayerWrapper]:
    """The compressor wrappers attached to ``layer`` (outermost last)."""
    ws = [v for k, v in vars(layer).items() if k.startswith(WRAPPER_PREFIX) and isinstance(v, LayerWrapper)]
    return sorted(ws, key=lambda w: w._order)


def _is_tensor_like(value: Any) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable, np.ndarray, np.generic, keras.Variable))


def _device_of(variable: Any) -> str | None:
    v = getattr(variable, "_value", variable)  # keras.Variable -> backing tf.Variable
    return getattr(v, "device", None) or None


@contextmanager
def _on_device(variable: Any):
    """Create variables next to ``variable``: on its device, or mirrored like it when it is a distributed
    (e.g. MirroredStrategy) variable, even outside ``strategy.scope()``."""
    if strategy_of(variable) is not None:
        with strategy_scope_of(variable):
            yield
        return
    dev = _device_of(variable)
    if dev:
        with tf.device(dev):
            yield
    else:
        yield


_ORDER = itertools.count()


class LayerWrapper(_Trackable):
    """Holds one Keras layer's compression state and intercepts its ``call``.

    Not a Keras layer: the model's graph, weights and config are unchanged; the wrapper is attached to
    the layer as a checkpoint dependency and replaces ``layer.call`` on the instance while installed.
    """

    def __init__(self, layer: keras.layers.Layer, layer_info: LayerInfo, config: dict[str, Any],
                 compressor: Compressor) -> None:
        super().__init__()
        self._setattr_raw("_state_vars", {})
        self.layer = layer
        self.layer_info = layer_info
        self.config = config
        self._compressor = compressor
        self._original_call: Callable[..., Any] | None = None
        self._order = next(_ORDER)

    # -- identity --------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.layer_info.name

    @property
    def type(self) -> str:
        return self.layer_info.type

    @property
    def compressor(self) -> Compressor:
        return self._compressor

    @property
    def slot(self) -> str | None:
        """The weight matrix this wrapper compresses of a recurrent / attention layer (see
        :mod:`compressor.tf.slots`), or None for a layer with one main weight."""
        return self.layer_info.extra.get("slot")

    @property
    def weight(self) -> Any:
        """The layer's main weight variable (kernel, depthwise kernel, BN gamma, ...; a slot's matrix) or
        None if unbuilt."""
        return layout.weight_of(self.layer, self.slot)

    @property
    def bias(self) -> Any:
        """The layer's bias variable (BN: beta) or None (always None for a slot)."""
        return None if self.slot is not None else layout.bias_of(self.layer)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} ({self.type})>"

    # -- state -----------------------------------------------------------------------------------------
    def _setattr_raw(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        state = self.__dict__.get("_state_vars")
        if state is not None and name in state and not isinstance(value, tf.Variable):
            var = state[name]
            var.assign(tf.cast(tf.convert_to_tensor(value), var.dtype))
            return
        super().__setattr__(name, value)

    def add_state(self, name: str, value: Any, dtype: Any = None) -> tf.Variable:
        """Create (or reset) a non-trainable variable attribute ``name`` on the weight's device."""
        state = self.__dict__["_state_vars"]
        if name in state:
            state[name].assign(tf.cast(tf.convert_to_tensor(value), state[name].dtype))
            return state[name]
        with tf.init_scope(), _on_device(self.weight):
            t = tf.convert_to_tensor(value)
            if dtype is not None:
                t = tf.cast(t, dtype)
            var = tf.Variable(t, trainable=False, name=name.replace("/", "_"))
        super().__setattr__(name, var)
        state[name] = var
        return var

    def state_variables(self) -> dict[str, tf.Variable]:
        """Variable attributes by name (masks, statistics, ``set_wrappers_attribute`` tensors)."""
        return dict(self.__dict__["_state_vars"])

    # -- the call --------------------------------------------------------------------------------------
    def forward(self, call_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the layer's call; subclasses transform inputs, weights (see :meth:`call_with_weights`)
        or outputs here."""
        return call_fn(*args, **kwargs)

    def call_with_weights(self, call_fn: Callable[..., Any], mapping: list[tuple[Any, Any]],
                          *args: Any, **kwargs: Any) -> Any:
        """``call_fn(*args, **kwargs)`` with each variable of ``mapping`` (``[(variable, tensor), ...]``;
        variables are unhashable, so not a dict) read as its tensor.

        Uses ``keras.StatelessScope``; updates the call makes to other variables of the layer (e.g. BN
        moving statistics) are applied to them afterwards, so nothing is lost. Gradients flow through the
        substituted tensors. Nested inside an outer stateless scope, the entries are added to it.
        """
        from keras.src.backend.common.stateless_scope import get_stateless_scope

        pairs = list(mapping)
        outer = get_stateless_scope()
        if outer is not None:
            saved = {id(k): outer.state_mapping.get(id(k), _MISSING) for k, _ in pairs}
            for k, v in pairs:
                outer.state_mapping[id(k)] = tf.cast(v, k.dtype)
            try:
                return call_fn(*args, **kwargs)
            finally:
                for k, _ in pairs:
                    prev = saved[id(k)]
                    if prev is _MISSING:
                        outer.state_mapping.pop(id(k), None)
                    else:
                        outer.state_mapping[id(k)] = prev
        mapped = {id(k) for k, _ in pairs}
        with keras.StatelessScope(state_mapping=pairs, initialize_variables=False) as scope:
            out = call_fn(*args, **kwargs)
        for v in self.layer.variables:
            if id(v) in mapped:
                continue
            new = scope.get_current_value(v)
            if new is not None:
                v.assign(new)
        return out

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        """Installed as ``layer.call``: forward, then the compressor's activation collectors."""
        out = self.forward(self._original_call, *args, **kwargs)
        for fn in list(self._compressor._collectors.values()):
            fn(self, args, out)
        return out

    # -- install / remove ------------------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return self._original_call is not None

    def _install(self, attr: str) -> None:
        from .slots import slot_attr

        attr = slot_attr(attr, self.layer_info)  # one wrapper per weight matrix of a recurrent / attention layer
        layer = self.layer
        if attr in vars(layer):
            raise ConfigError(f"layer {self.name!r} is already wrapped by "
                              f"{type(vars(layer)[attr].compressor).__name__}; strip it first")
        self._setattr_raw("_attr", attr)
        self._original_call = layer.call  # the class's bound method, or an inner wrapper's _call
        object.__setattr__(layer, "call", self._call)
        setattr(layer, attr, self)  # checkpoint dependency (AutoTrackable tracking)

    def _uninstall(self) -> None:
        if not self.installed:
            return
        layer = self.layer
        current = vars(layer).get("call")
        if current == self._call:
            inner = self._original_call
            if getattr(inner, "__self__", None) is layer and getattr(inner, "__func__", None) is type(layer).call:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", inner)
        else:  # someone wrapped after us: splice ourselves out of the chain
            for other in wrappers_of(layer):
                if other is not self and other._original_call == self._call:
                    other._original_call = self._original_call
        self._original_call = None
        if vars(layer).get(self._attr) is self:
            delattr(layer, self._attr)


_MISSING = object()


class Compressor:
    """Base of TF pruners and quantizers (see the module docstring for the contract)."""

    #: extra config keys this algorithm accepts (names in core.config.OPTIONAL_KEYS or KeySpec objects)
    config_keys: tuple[Any, ...] = ()
    #: keys every non-excluded config entry must have
    required_keys: tuple[str, ...] = ()
    #: what ``op_types: ['default']`` means
    default_types: tuple[str, ...] = DEFAULT_TYPES
    #: the advice of the warning on what ``'default'`` leaves out (None: add those types to op_types)
    default_skip_hint: str | None = None
    #: wrappers of one kind are never stacked on a layer ('pruner', 'quantizer')
    _kind: str = "compressor"
    #: under tf.distribute, reduce per-batch data statistics over the replicas before they are accumulated
    #: (see :mod:`compressor.tf.distributed`); set False on an instance to opt out
    sync_ranks: bool = True

    @property
    def wrapper_attr(self) -> str:
        """Attribute of a wrapped layer that holds this compressor's wrapper."""
        return WRAPPER_PREFIX + self._kind

    def __init__(self, model: Any, config_list: Any, optimizer: Any = None) -> None:
        what = type(self).__name__
        if not isinstance(model, keras.layers.Layer):
            raise ModelError(f"{what}: model must be a Keras 3 model or layer, got "
                             f"{type(model).__module__}.{type(model).__qualname__}"
                             + (" (a tf_keras / Keras 2 model? compressor.tf supports Keras 3 only)"
                                if "keras" in type(model).__module__ else ""))
        check_optimizer(optimizer, what)
        self.config_list = normalize_config_list(config_list, extra_keys=self.config_keys,
                                                 required=self.required_keys, what=what)
        self.validate_config(self.config_list)
        self.model = self.bound_model = model
        self.optimizer = optimizer
        layers = iter_layers(model)
        by_name = {path: layer for path, layer in layers}
        infos = [LayerInfo(path, type(layer).__name__, {"layer": layer, **layout.weight_facts(layer)},
                           keras_base_type(layer)) for path, layer in layers]
        selected = match_layers(infos, self.config_list, self.default_types, what=type(self).__name__,
                                skip_hint=self.default_skip_hint)
        selected = self._substitute_layers(selected, infos, by_name)
        from .slots import expand_slots, slot_attr  # recurrent / attention layers: one slot per weight matrix

        selected = expand_slots(what, selected, by_name)
        for info, config in selected:
            layer = by_name[info.name]
            attr = slot_attr(self.wrapper_attr, info)
            if attr in vars(layer):
                raise ConfigError(f"{what}: layer {info.name!r} is already wrapped by "
                                  f"{type(vars(layer)[attr].compressor).__name__}; call strip() on "
                                  f"that {self._kind} (or export and reload the model) before compressing it again")
            self.validate_layer(info, layer, config)
        extra = self._extra_layers(model, selected, infos, by_name)
        selected = self._filter_selected(selected) + extra
        self.modules_to_compress = [(info, config) for info, config in selected]
        self._collectors: dict[int, Callable[..., Any]] = {}
        self._collector_ids = itertools.count()
        anchor = next(iter(getattr(model, "weights", ()) or ()), None)  # mirror the step like the model's weights
        with tf.init_scope(), _on_device(anchor):
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="compressor_step")
        self.epoch = 0
        # build every wrapper before touching the model
        self.modules_wrapper = [self._create_wrapper(by_name[info.name], info, config) for info, config in selected]
        for w in self.modules_wrapper:
            if not isinstance(w, LayerWrapper):
                raise TypeError(f"{what}._create_wrapper must return a LayerWrapper, got {type(w).__name__}")
        # mutate the model last
        self._instrument()
        if optimizer is not None:
            try:
                self._hook(optimizer)
            except BaseException:
                with deferred_interrupts():
                    self.unhook()
                    self._unwrap_model()
                raise

    # -- overridable -----------------------------------------------------------------------------------
    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        """Cross-entry checks on the normalised config (raise ConfigError); before any mutation."""

    def validate_layer(self, layer_info: LayerInfo, layer: keras.layers.Layer, config: dict[str, Any]) -> None:
        """Refuse a selected layer by raising ConfigError (called before any mutation)."""

    def _substitute_layers(self, selected: list[tuple[LayerInfo, dict[str, Any]]], layers: list[LayerInfo],
                           by_name: dict[str, Any]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """The layers actually wrapped for the config's selection (e.g. a pruner selecting
        MultiHeadAttention layers wraps their value projections). Called before anything is validated
        or changed; may raise ConfigError."""
        return selected

    def _extra_layers(self, model: Any, selected: list[tuple[LayerInfo, dict[str, Any]]], layers: list[LayerInfo],
                      by_name: dict[str, Any]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """Layers to wrap besides the config's (e.g. the norms a dependency-aware pruner masks with their
        convs). Called before anything is changed; may raise ConfigError."""
        return []

    def _filter_selected(self, selected: list[tuple[LayerInfo, dict[str, Any]]]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """The validated selection without the layers that will not be wrapped after all (e.g. those a
        dependency-aware pruner finds speedup could never shrink). Called after :meth:`_extra_layers`,
        before anything is changed."""
        return selected

    def _create_wrapper(self, layer: keras.layers.Layer, layer_info: LayerInfo, config: dict[str, Any]) -> LayerWrapper:
        raise NotImplementedError(f"{type(self).__name__} must implement _create_wrapper()")

    def compress(self) -> keras.layers.Layer:
        """Compute the initial compression state; returns the (same, instrumented) model."""
        return self.model

    def update_epoch(self, epoch: int) -> None:
        """Tell the compressor a new epoch begins (AGP and other epoch schedules)."""
        self.epoch = int(epoch)

    def step(self) -> None:
        """Called after each optimizer update (in-graph under tf.function): advances the step counter.

        The optimizer hook calls it; with an unhooked optimizer call it yourself after each update.
        Subclasses that override it call ``super().step()``.
        """
        self._step.assign_add(1)

    def _gradients_hook(self, pairs: list[tuple[Any, Any]]) -> None:
        """``(gradient, variable)`` pairs of the update just applied (in-graph); for gradient statistics."""

    # -- accessors -------------------------------------------------------------------------------------
    def get_modules_to_compress(self) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """``(LayerInfo, config)`` of each selected layer, in model order."""
        return list(self.modules_to_compress)

    def get_modules_wrapper(self) -> list[LayerWrapper]:
        return list(self.modules_wrapper)

    def set_wrappers_attribute(self, name: str, value: Any) -> None:
        """Give every wrapper an attribute ``name``: tensors/arrays become non-trainable variables."""
        for w in self.modules_wrapper:
            if _is_tensor_like(value):
                w.add_state(name, tf.convert_to_tensor(value))
            else:
                setattr(w, name, copy.copy(value) if isinstance(value, (list, dict, set)) else value)
        self._retrace()

    def add_activation_collector(self, collector: Callable[[LayerWrapper, tuple, Any], Any]) -> int:
        """Run ``collector(wrapper, inputs, output)`` after every call of every wrapped layer; returns an id."""
        if not callable(collector):
            raise TypeError(f"collector must be callable, got {type(collector).__name__}")
        cid = next(self._collector_ids)
        self._collectors[cid] = collector
        self._retrace()
        return cid

    def remove_activation_collector(self, collector_id: int) -> None:
        if collector_id not in self._collectors:
            raise ValueError(f"no activation collector with id {collector_id!r}; active: {sorted(self._collectors)}")
        del self._collectors[collector_id]
        self._retrace()

    @property
    def step_count(self) -> tf.Variable:
        """Optimizer updates seen (a graph-safe int64 variable)."""
        return self._step

    # -- instrumentation and clock ---------------------------------------------------------------------
    def _instrument(self) -> None:
        done = []
        try:
            for w in self.modules_wrapper:
                done.append(w)  # recorded before it changes its layer: one interrupted half way is undone too
                w._install(self.wrapper_attr)
            self._retrace()
        except BaseException:  # Ctrl-C too: every layer back as it was, a second Ctrl-C held back meanwhile
            with deferred_interrupts():
                for w in reversed(done):
                    w._uninstall()
                self._retrace()
            raise

    def _unwrap_model(self) -> keras.layers.Layer:
        """Remove the instrumentation (the wrappers keep their state); returns the same model object."""
        for w in reversed(self.modules_wrapper):
            w._uninstall()
        self._retrace()
        return self.model

    def _wrap_model(self) -> keras.layers.Layer:
        """Undo :meth:`_unwrap_model`."""
        for w in self.modules_wrapper:
            if not w.installed:
                w._install(self.wrapper_attr)
        self._retrace()
        return self.model

    def strip(self) -> keras.layers.Layer:
        """Remove the instrumentation and the optimizer hook for good; returns the plain model."""
        self.unhook()
        return self._unwrap_model()

    def hook_optimizer(self, optimizer: keras.optimizers.Optimizer) -> None:
        """Run :meth:`step` after each ``optimizer.apply`` (releasing a previously hooked other optimizer).
        Idempotent. Hook before the first ``fit`` / trace, or retrace (this resets the model's functions)."""
        check_optimizer(optimizer, type(self).__name__)
        if optimizer is None:
            raise ConfigError(f"{type(self).__name__}.hook_optimizer needs an optimizer, got None")
        if self.optimizer is not None and self.optimizer is not optimizer:
            hooks.unhook_optimizer(self.optimizer, self)
        hooks.hook_optimizer(optimizer, self)
        self.optimizer = optimizer
        self._retrace()

    _hook = hook_optimizer

    def unhook(self) -> None:
        """Remove this compressor's optimizer hook (the optimizer is restored once no hook is left)."""
        if self.optimizer is not None:
            hooks.unhook_optimizer(self.optimizer, self)
            self._retrace()

    def state_dict(self) -> dict[str, Any]:
        """The compressor's own position (epoch, step); tensors live in the wrappers' variables."""
        return {"epoch": self.epoch, "step": int(self._step.numpy())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.epoch = int(state.get("epoch", self.epoch))
        if "step" in state:
            self._step.assign(int(state["step"]))

    def _after_optimizer_apply(self, grads: Iterable[Any], variables: Iterable[Any]) -> None:
        """Called by the optimizer hook right after ``optimizer.apply`` (traced into the train step)."""
        self._gradients_hook([(g, v) for g, v in zip(grads, variables) if g is not None])
        self.step()

    def _retrace(self) -> None:
        """Make the model's cached fit/evaluate/predict functions trace the new graph on their next call."""
        retrace_model(self.model)


def retrace_model(model: Any) -> None:
    """Replace a Keras model's cached train/test/predict ``tf.function``s by fresh (untraced) ones.

    Safe in the middle of ``fit`` (e.g. from a callback): the loop looks the function up at every step.
    """
    for attr, make in (("train_function", "make_train_function"), ("test_function", "make_test_function"),
                       ("predict_function", "make_predict_function")):
        if getattr(model, attr, None) is not None and hasattr(model, make):
            getattr(model, make)(force=True)


def strip_model(model: keras.layers.Layer) -> keras.layers.Layer:
    """Remove every compressor wrapper from ``model`` in place (e.g. when the compressor object is gone).

    Weights are left as they are (pruners keep pruned weights at zero in place); returns ``model``.
    """
    for _, layer in iter_layers(model):
        for w in reversed(wrappers_of(layer)):
            comp = w.compressor
            w._uninstall()
            if comp is not None and not any(x.installed for x in comp.modules_wrapper):
                comp.unhook()
    retrace_model(model)
    return model
