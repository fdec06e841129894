"""Hydra callback that writes the sweep report (:mod:`remat.reporting`) of a multirun."""

from __future__ import annotations

import logging
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class SweepReport(Callback):
    """Writes ``report.md``, ``report.csv`` and the plots into ``hydra.sweep.dir``: after
    every job of a multirun (so a sweep whose job failed, for which Hydra skips
    ``on_multirun_end``, still has a report listing every job so far), and once more in
    ``on_multirun_end``. A report that cannot be made is logged, never raised: it must not
    fail the sweep."""

    def _write(self, config: DictConfig, final: bool) -> None:
        from remat.reporting import report

        root = OmegaConf.select(config, "hydra.sweep.dir", default=None)
        if not root:
            return
        try:
            report(str(root), quiet=not final)
        except Exception as err:  # noqa: BLE001 - a report must never fail the sweep
            log.warning("sweep report of %s not written: %s: %s", root, type(err).__name__, err)

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if OmegaConf.select(config, "hydra.mode", default=None) == RunMode.MULTIRUN:
            self._write(config, final=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._write(config, final=True)
