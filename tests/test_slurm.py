"""+cluster=slurm: Hydra's submitit launcher sets the trainer's nodes and devices, and the
sbatch script submitit writes from it asks SLURM for one task per GPU on every node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from remat.callbacks.run_dir import secondary_rank
from remat.run_shape import sharding_of
from tests.helpers import compose_train

OVERRIDES = ["+cluster=slurm", "trainer=fsdp", "hydra.launcher.nodes=2",
             "hydra.launcher.tasks_per_node=4", "hydra.launcher.partition=gpu"]


def test_trainer_nodes_and_devices_follow_the_launcher(tmp_path):
    cfg = compose_train(tmp_path, OVERRIDES)
    assert cfg.trainer.num_nodes == 2 and cfg.trainer.devices == 4
    assert cfg.trainer.accelerator == "gpu"
    assert cfg.hydra.launcher.gpus_per_node == 4
    assert str(cfg.hydra.launcher._target_).endswith("SlurmLauncher")
    assert sharding_of(cfg).world_size == 8  # per-rank planning sees all 8 ranks


def test_sbatch_script_from_the_launcher_config(tmp_path, monkeypatch):
    """submitit needs ``srun`` on PATH to build its executor; a stand-in is enough to write
    the script (nothing is submitted)."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    cfg = compose_train(tmp_path / "run", OVERRIDES)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params.pop("_target_")
    launcher = SlurmLauncher(**params)
    # the executor as the launcher builds it (hydra_submitit_launcher.launch)
    executor = submitit.AutoExecutor(cluster="slurm", folder=str(tmp_path / "submitit"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v
                                  for k, v in launcher.params.items()
                                  if k not in ("submitit_folder", "max_num_timeout")})
    script = executor._executor._make_submission_file_text("python -u -m submitit.core._submit "
                                                           "JOB", "uid")
    lines = set(script.splitlines())
    for expected in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4",
                     "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=8",
                     "#SBATCH --partition=gpu", "#SBATCH --time=1440",
                     "#SBATCH --signal=USR2@120"):
        assert expected in lines, script
    assert any(line.startswith("srun ") and line.endswith("submitit.core._submit JOB")
               for line in lines), script


@pytest.mark.parametrize("env,secondary", [
    ({}, False),
    ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, False),
    ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1"}, True),
    ({"RANK": "1", "LOCAL_RANK": "1"}, True),
    ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, True)])
def test_ranks_above_zero_share_rank_zeros_run_folder(monkeypatch, tmp_path, env, secondary):
    from remat.callbacks.run_dir import RANK_VARIABLES, claim_run_dir, release_run_dir

    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert secondary_rank() is secondary
    folder: Path = claim_run_dir(tmp_path / "run")
    try:
        # a secondary rank takes no lock, so rank 0 (another process) keeps holding it
        assert (folder / ".lock").exists() is not secondary
    finally:
        release_run_dir(folder)


def test_a_resubmitted_job_resumes_from_its_last_checkpoint(tmp_path, monkeypatch):
    """What submitit calls on preemption/time-out (the launcher's ``checkpoint``) resubmits
    the job with its own arguments and ``ckpt_path=last``."""
    from hydra.utils import get_class

    from remat.slurm import SlurmLauncher, resumed_overrides

    cfg = compose_train(tmp_path / "run", OVERRIDES)
    assert get_class(cfg.hydra.launcher._target_) is SlurmLauncher
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params.pop("_target_")
    launcher = SlurmLauncher(**params)
    delayed = launcher.checkpoint(["strategy=sqrtn", "ckpt_path=/old/last.ckpt"],
                                  "hydra.sweep.dir", 3, "job_id_for_3", {"state": 1})
    assert delayed.function is launcher
    assert delayed.args == (["strategy=sqrtn", "ckpt_path=last"], "hydra.sweep.dir", 3,
                            "job_id_for_3", {"state": 1})
    assert resumed_overrides(["+ckpt_path=x", "a=1"]) == ["a=1", "ckpt_path=last"]


def test_preemption_signal_writes_the_checkpoint_before_the_requeue(tmp_path, monkeypatch):
    """A stand-in for submitit's USR2 handler (requeue) is installed when training starts:
    the signal is held until the optimizer step is complete, the checkpoint is written, then
    the handler runs once; the resubmitted job (``ckpt_path=last``, same folder) trains the
    rest with the uninterrupted run's per-step losses."""
    import signal

    import torch

    from remat.train import train
    from tests.helpers import TINY_TRAINER, logged

    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    base = ["data.image_size=32", "data.num_train=8", "data.num_val=2", "data.batch_size=2",
            "model.arch_kwargs.decoder_channels=[16,16,8,8,8]", *TINY_TRAINER,
            "trainer.max_epochs=2", "trainer.log_every_n_steps=1"]
    train(compose_train(tmp_path / "straight", base))
    run = tmp_path / "run"
    calls = []

    def requeue(signum, frame):  # what submitit's handler would do, on rank 0
        calls.append((signum, torch.load(run / "checkpoints" / "last.ckpt",
                                         weights_only=False)["global_step"]))

    previous = signal.signal(signal.SIGUSR2, requeue)
    try:
        with pytest.raises(SystemExit) as stop:
            train(compose_train(run, [*base, "+callbacks.kill._target_=tests.helpers.SignalAtStep",
                                      "+callbacks.kill.step=1", "+callbacks.kill.signal=SIGUSR2"]))
        assert stop.value.code == 128 + signal.SIGUSR2
        assert calls == [(signal.SIGUSR2, 2)]  # step 2 written (mid-epoch), then the handler
        assert signal.getsignal(signal.SIGUSR2) is requeue  # given back after training
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "interrupted" and summary["signal"] == "SIGUSR2"
    finally:
        signal.signal(signal.SIGUSR2, previous)
    resumed = train(compose_train(run, [*base, "ckpt_path=last"]))  # the resubmitted job
    assert resumed["status"] == "completed" and resumed["global_step"] == 8
    assert logged(run, "train/loss_step") == logged(tmp_path / "straight", "train/loss_step")


def test_preemption_reaching_another_rank_hands_every_rank_to_its_handler():
    """Under DDP/FSDP the scheduler's signal may reach rank 1 only: rank 0, whose submitit
    handler is the one that resubmits, must still call it once the ranks stopped. Rank 0's
    view here: the two all-reduces (anyone stopping? anyone preempted?) say yes."""
    import signal
    from types import SimpleNamespace

    from remat.callbacks import LastCheckpoint
    from remat.runs import hand_on_preemption

    calls = []
    last = LastCheckpoint("unused")
    last._preemption = (int(signal.SIGUSR2), lambda signum, frame: calls.append(signum))
    votes = []

    def reduce_boolean_decision(mine, all=True):  # noqa: A002 - Lightning's keyword
        votes.append(mine)
        return True  # the other rank's vote
    trainer = SimpleNamespace(world_size=2, strategy=SimpleNamespace(
        reduce_boolean_decision=reduce_boolean_decision))
    assert last._signalled(trainer)
    assert votes == [False, False]  # this rank had no signal of its own
    assert last.received_signal == "SIGUSR2" and last.deferred == last._preemption
    hand_on_preemption([last])
    assert calls == [signal.SIGUSR2]
