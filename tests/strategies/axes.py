"""The strategy axes of the suite, read from the registry (:data:`remat.strategies.STRATEGIES`):
a newly registered strategy is tested by every parametrised test without editing one.

A test picks the variants it can check through the strategy's declared capabilities
(``recomputes``, ``measurable_on_cpu``, ``shardable``), never through a list of names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from remat.strategies import STRATEGIES, CheckpointStrategy, build_strategy

#: Constructor arguments each strategy is tested with (a strategy not named here: its
#: defaults, one variant). ``compile`` on ``aot_eager``: no C++ compiler needed.
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "every_k": [{"k": 2}],
    "selective": [{"policy": "matmul"}, {"policy": "attention"}],
    "offload": [{}, {"segments": "sqrtn"}],
    "compile": [{"backend": "aot_eager"}],
}
#: The reference every axis compares against, so not one of its rows.
BASELINE = "none"
#: Strategies that work on some models only; their own module tests them instead.
OWN_TESTS: dict[str, str] = {
    "timm_native": "tests/strategies/test_timm_native.py (timm models with set_grad_checkpointing)",
}


def variants(where: Callable[[CheckpointStrategy], bool] = lambda s: True,
             baseline: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """``(registry name, constructor arguments)`` of every registered strategy variant
    (:data:`VARIANTS`) whose built strategy satisfies ``where``, in registry order; the
    baseline ``none`` first with ``baseline=True``, :data:`OWN_TESTS` never."""
    rows = []
    for name in STRATEGIES:
        if name in OWN_TESTS or (name == BASELINE and not baseline):
            continue
        for args in VARIANTS.get(name, [{}]):
            if name == BASELINE or where(build_strategy(name, **args)):
                rows.append((name, args))
    return rows


def names(where: Callable[[CheckpointStrategy], bool] = lambda s: True,
          baseline: bool = False) -> list[str]:
    """Registry names of the strategies that, built with their defaults, satisfy ``where``
    (the baseline first with ``baseline=True``, :data:`OWN_TESTS` never)."""
    return [name for name in STRATEGIES if name not in OWN_TESTS
            and (name == BASELINE and baseline
                 or name != BASELINE and where(build_strategy(name)))]


def eager(strategy: CheckpointStrategy) -> bool:
    """Runs as eager PyTorch: the tensor-level tracker sees what it keeps (not compiled)."""
    return strategy.measurable_on_cpu


def recomputing(strategy: CheckpointStrategy) -> bool:
    """Eager, and recomputes its units' forward in backward (remat's recompute: a block's
    forward is called again, which a hook can count)."""
    return strategy.measurable_on_cpu and strategy.recomputes


def compiled(strategy: CheckpointStrategy) -> bool:
    """Works in compiled code, which the tensor-level tracker does not see."""
    return not strategy.measurable_on_cpu
