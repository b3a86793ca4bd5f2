"""The one-shot filter pruners' constructors, shared by both backends (core mixins over a fake base)."""

from typing import Any

import pytest

from compressor.core.errors import ConfigError
from compressor.core.pruner_config import ActivationPrunerArgs, FilterPrunerArgs, TaylorPrunerArgs


class _OneShot:
    def __init__(self, model: Any, config_list: Any, optimizer: Any = None, dependency_aware: bool = False,
                 dummy_input: Any = None, **masker_kwargs: Any) -> None:
        self.got = (model, config_list, optimizer, dependency_aware, dummy_input, masker_kwargs)


class Filter(FilterPrunerArgs, _OneShot):
    pass


class Act(ActivationPrunerArgs, _OneShot):
    pass


class Taylor(TaylorPrunerArgs, _OneShot):
    pass


def test_arguments_reach_the_base():
    assert Filter("m", [], "opt", True, "x").got == ("m", [], "opt", True, "x", {})
    assert Act("m", [], None, "relu6", 3, True, "x").got == (
        "m", [], None, True, "x", {"activation": "relu6", "statistics_batch_num": 3})
    assert Taylor("m", [], statistics_batch_num=2).got == ("m", [], None, False, None, {"statistics_batch_num": 2})
    with pytest.raises(TypeError):
        Filter("m", [], activation="relu")  # filter criteria take no statistics options


def test_bad_arguments_are_refused_naming_the_pruner():
    with pytest.raises(ConfigError, match=r"Act: activation = 'tanh' is invalid; allowed: \['relu', 'relu6'\]"):
        Act("m", [], activation="tanh")
    with pytest.raises(ConfigError, match="Act: statistics_batch_num = 0 is invalid; allowed: an int >= 1"):
        Act("m", [], statistics_batch_num=0)
    with pytest.raises(ConfigError, match="Taylor: statistics_batch_num = True is invalid; allowed: an int >= 1"):
        Taylor("m", [], statistics_batch_num=True)
