"""SLURM jobs that are preempted or reach their time limit go on where they stopped.

Hydra's submitit launcher resubmits a job that submitit's preemption signal (``USR2`` by
default, ``#SBATCH --signal=USR2@120``) reaches, with the arguments it started with: the
same overrides, job number and sweep folder (Hydra copies the sweep's resolved timestamps
and ``remat.run_id`` into each job's config), so the same run folder, but no
``ckpt_path``: the resubmitted job trained from scratch over the run's checkpoints.
:class:`SlurmLauncher` resubmits it with ``ckpt_path=last``.

The checkpoint it resumes from is written first: :class:`remat.callbacks.LastCheckpoint`
holds the preemption signal like SIGTERM (the current optimizer step completes, every rank
stops after it, ``last.ckpt`` is written) and :func:`remat.runs.hand_on_preemption` then
gives the signal to submitit's handler, which resubmits the job.
"""

from __future__ import annotations

from typing import Any

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    SlurmLauncher as SubmititSlurmLauncher,
)

#: the override a resubmitted job gets (the newest last.ckpt of its run folder)
RESUME_OVERRIDE = "ckpt_path=last"


def resumed_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` with any ``ckpt_path`` replaced by ``ckpt_path=last``."""
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "ckpt_path"]
    return [*kept, RESUME_OVERRIDE]


class SlurmLauncher(SubmititSlurmLauncher):
    """Hydra's submitit SLURM launcher whose resubmitted jobs resume: ``checkpoint`` (what
    submitit calls on preemption or time-out, before it requeues the job) adds
    ``ckpt_path=last`` to the job's overrides. Takes the same parameters
    (``hydra/launcher: submitit_slurm``; ``+cluster=slurm`` selects this class)."""

    def checkpoint(self, sweep_overrides: list[str], *args: Any, **kwargs: Any) -> Any:
        """The job submitted again: same arguments, overrides resumed
        (:func:`resumed_overrides`); a ``submitit.helpers.DelayedSubmission``."""
        return super().checkpoint(resumed_overrides(list(sweep_overrides)), *args, **kwargs)
