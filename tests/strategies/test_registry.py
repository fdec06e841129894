"""Python and Hydra users get the same strategy objects."""

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from remat.config import config_dir
from remat.planner import BudgetStrategy, PlanStrategy
from remat.strategies import STRATEGIES, build_strategy

# the planner's two (remat.planner builds on remat.strategies, so they are not in its
# registry): a budget is planned before the model is built, a plan needs its file
PLANNED = {"budget": BudgetStrategy, "plan": PlanStrategy}
CONFIGS = sorted(p for p in (config_dir() / "strategy").glob("*.yaml") if p.stem not in PLANNED)


def test_every_registered_strategy_has_a_config_and_back():
    assert sorted(p.stem for p in CONFIGS) == sorted(STRATEGIES)
    planned = sorted(p.stem for p in (config_dir() / "strategy").glob("*.yaml")
                     if p.stem in PLANNED)
    assert planned == sorted(PLANNED)


def test_planner_configs_build_the_planner_strategies(tmp_path):
    budget = instantiate(OmegaConf.load(config_dir() / "strategy" / "budget.yaml"))
    assert type(budget) is BudgetStrategy and budget.name == "budget" and budget.needs_plan
    assert budget.budget_bytes == int(0.8 * budget.spec.memory_bytes)
    cfg = OmegaConf.load(config_dir() / "strategy" / "plan.yaml")
    assert cfg._target_ == "remat.planner.PlanStrategy" and OmegaConf.is_missing(cfg, "path")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_and_build_strategy_make_the_same_object(path):
    cfg = OmegaConf.load(path)
    from_hydra = instantiate(cfg)
    args = {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "_target_"}
    from_python = build_strategy(path.stem, **args)
    assert type(from_hydra) is type(from_python) is STRATEGIES[path.stem]
    assert repr(from_hydra) == repr(from_python)
    assert from_hydra.name == path.stem


def test_bad_arguments_name_the_strategy():
    with pytest.raises(ValueError, match="strategy 'sqrtn' does not take"):
        build_strategy("sqrtn", k=3)


def test_the_test_axes_cover_every_registered_strategy():
    """tests/strategies/axes.py reads the registry: each name is on an axis or has its own
    module, and the variants it names are registered ones."""
    from tests.strategies import axes

    on_axes = {name for name, _ in axes.variants(baseline=True)}
    assert on_axes | set(axes.OWN_TESTS) == set(STRATEGIES)
    assert not on_axes & set(axes.OWN_TESTS)
    assert set(axes.VARIANTS) <= set(STRATEGIES)
    assert axes.variants(axes.compiled) == [("compile", {"backend": "aot_eager"})]
    assert ("offload", {}) in axes.variants(axes.eager)
    assert ("offload", {}) not in axes.variants(axes.recomputing)  # keeps, moves to host
