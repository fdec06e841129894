"""Loggers: Lightning's CSV logger, appending to a resumed run's ``metrics.csv``."""

from __future__ import annotations

import csv
from typing import Any

from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer without the delete: an existing ``metrics.csv`` is kept and its
    header becomes the starting column set (new columns rewrite the header, as Lightning
    does)."""

    def _check_log_dir_exists(self) -> None:
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
            header = next(csv.reader(handle), [])
        self.metrics_keys = [k for k in header if k]  # the file's column order


class CSVLogger(_LightningCSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that appends to ``<save_dir>/<name>/<version>/
    metrics.csv`` when it exists (a run resumed into its own folder keeps the rows it
    logged before the interruption), instead of deleting it. Same arguments as Lightning's.
    """

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
