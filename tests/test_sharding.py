"""remat.sharding: FSDP units from a strategy's report, the order strategy -> shard, and the
error of the other order (one process, gloo, world size 1)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from remat.sharding import shard, shard_units
from remat.strategies import StageError, build_strategy
from tests.fsdp_script import make_module, make_windows


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _batch() -> dict[str, torch.Tensor]:
    return torch.utils.data.default_collate(make_windows(2))


@pytest.mark.parametrize("strategy,units", [
    ("none", [["net.blocks.0"], ["net.blocks.1"], ["net.blocks.2"], ["net.blocks.3"]]),
    ("full", [["net.blocks.0"], ["net.blocks.1"], ["net.blocks.2"], ["net.blocks.3"]]),
    ("sqrtn", [["net.blocks.0", "net.blocks.1"], ["net.blocks.2", "net.blocks.3"]]),
    ("selective", [["net.blocks.0"], ["net.blocks.1"], ["net.blocks.2"], ["net.blocks.3"]])])
def test_shard_units_follow_the_strategy_segments(strategy, units):
    module = make_module(strategy)
    report = build_strategy(strategy).apply(module, ["net.blocks"])
    assert shard_units(module, report) == units


def test_a_plan_keeping_some_blocks_gives_them_units_of_their_own():
    from remat.strategies import StrategyReport

    module = make_module("none")
    report = StrategyReport("plan", stages=["net.blocks"], segments={"net.blocks": [(1, 3)]})
    assert shard_units(module, report) == [["net.blocks.0"], ["net.blocks.1", "net.blocks.2"],
                                           ["net.blocks.3"]]


def test_shard_after_the_strategy_trains_like_the_unsharded_model(mesh):
    reference = make_module("sqrtn").train()
    reference.training_loss(_batch()).backward()
    module = make_module("sqrtn").train()
    report = shard(module.net, mesh, module.strategy_report)
    assert report.units == [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]
    assert isinstance(module.net, FSDPModule) and isinstance(module.net.blocks[1], FSDPModule)
    # one FSDP unit per segment: both blocks share the state
    assert module.net.blocks[0]._get_fsdp_state() is module.net.blocks[1]._get_fsdp_state()
    module.training_loss(_batch()).backward()
    for (name, p), q in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7,
                                   msg=name)


def test_sharding_block_by_block_under_a_segment_strategy_names_the_segment(mesh):
    module = make_module("sqrtn").train()
    for block in module.net.blocks:  # the other order: one unit per block
        fully_shard(block, mesh=mesh)
    fully_shard(module.net, mesh=mesh)
    with pytest.raises(StageError, match=r"segment 'blocks\[0:2\]'.*'blocks.0' and 'blocks.1'"
                                         r".*different FSDP units.*remat.sharding.shard"):
        module.training_loss(_batch())


def test_sharding_twice_is_refused(mesh):
    module = make_module("full")
    shard(module.net, mesh, module.strategy_report)
    with pytest.raises(StageError, match="already sharded.*apply the strategy first"):
        shard(module.net, mesh, module.strategy_report)


def test_sharding_of_reads_world_size_or_the_fsdp_trainer(tmp_path):
    from omegaconf import OmegaConf

    from remat.run_shape import Sharding, sharding_of
    from tests.helpers import compose_train

    assert sharding_of(compose_train(tmp_path / "a", [])) == Sharding(1, True)
    cfg = compose_train(tmp_path / "b", ["trainer=fsdp", "trainer.devices=4",
                                         "trainer.num_nodes=2",
                                         "trainer.strategy.reshard_after_forward=false"])
    assert sharding_of(cfg) == Sharding(8, False)
    assert sharding_of(OmegaConf.create({"world_size": 3})) == Sharding(3, True)
    with pytest.raises(ValueError, match="world_size"):
        sharding_of(OmegaConf.create({"world_size": 0}))
    # FSDP2 on one rank still gathers each unit while it runs: sharded, over one rank
    cfg = compose_train(tmp_path / "d", ["trainer=fsdp", "trainer.devices=1"])
    assert sharding_of(cfg) == Sharding(1, True, fsdp=True) != Sharding(1, True)
    assert sharding_of(OmegaConf.create({"world_size": 1})).fsdp
    assert not sharding_of(OmegaConf.create({"world_size": None})).fsdp
    cfg = compose_train(tmp_path / "c", ["trainer=fsdp", "trainer.devices=auto"])
    with pytest.raises(ValueError, match=r"trainer=fsdp: trainer.devices='auto'"):
        sharding_of(cfg)


def test_effective_batch_not_divisible_by_world_size_names_both_keys(tmp_path):
    from remat.planner.frontier import micro_batches
    from tests.helpers import compose_app

    cfg = compose_app("plan", tmp_path, ["model=gpt_tiny", "world_size=4"])
    with pytest.raises(ValueError, match=r"effective_batch_size=6 is not a multiple of "
                                         r"world_size=4"):
        micro_batches(cfg, "1GiB", 6)


def test_bench_fsdp_needs_a_multi_process_launch(tmp_path, monkeypatch):
    from remat.bench import bench
    from tests.helpers import compose_app

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = compose_app("bench", tmp_path, ["model=gpt_tiny", "fsdp=true"])
    with pytest.raises(ValueError, match=r"torch.distributed.run --nproc-per-node 2 -m "
                                         r"remat.bench fsdp=true"):
        bench(cfg)


def test_a_strategy_that_says_it_cannot_be_sharded_is_refused_naming_both_keys(mesh):
    """configure_model under Lightning's ModelParallelStrategy (the trainer=fsdp path)."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    module = make_module("full")
    module.strategy.shardable = False
    trainer = SimpleNamespace(strategy=ModelParallelStrategy.__new__(ModelParallelStrategy))
    module._trainer = trainer
    with pytest.raises(StageError, match="trainer=fsdp cannot shard a network under "
                                         "strategy=full"):
        module.configure_model()


@pytest.mark.slow  # 10 s; the per-rank estimate of a 2-rank run: tests/test_fsdp.py
def test_one_rank_fsdp_estimate_counts_the_gathered_units():
    """``trainer=fsdp trainer.devices=1``: the trace shards over a 1-rank (fake) group, as
    the run does, so each unit's gathered parameters are counted; was traced unsharded
    (17.8 MiB predicted, 19.3 MiB measured on the tiny GPT of experiment=shakespeare_gpt)."""
    import torch

    from remat.measure.trace import trace_step
    from tests.fsdp_script import MEMORY_BATCH, memory_module

    def run(**kw):
        return trace_step(lambda: memory_module("sqrtn"), *MEMORY_BATCH,
                          torch.device("cpu"), "32-true", **kw)[1]

    fake, real = run(world_size=1, fsdp=True), run(world_size=1, fsdp=True, fake=False)
    unsharded = run()
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.03 * real.peak_bytes
    assert fake.peak_bytes > unsharded.peak_bytes
