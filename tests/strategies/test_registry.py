"""Python and Hydra users get the same strategy objects."""

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from remat.config import config_dir
from remat.strategies import STRATEGIES, build_strategy

CONFIGS = sorted((config_dir() / "strategy").glob("*.yaml"))


def test_every_registered_strategy_has_a_config_and_back():
    assert sorted(p.stem for p in CONFIGS) == sorted(STRATEGIES)


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
