"""Loggers: Lightning's CSV logger, appending to a resumed run's ``metrics.csv``."""

from __future__ import annotations

import csv
from typing import Any

from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

#: where a resumed run puts the rows an earlier run logged after the checkpoint it resumes
#: from (next to ``metrics.csv``)
REPLAYED_FILE = "metrics.replayed.csv"


def _step_of(row: dict[str, str]) -> int | None:
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer without the delete: an existing ``metrics.csv`` is kept and its
    header becomes the starting column set (new columns rewrite the header, as Lightning
    does, after the file's columns). ``previous_rows``: the rows the file held when this run
    opened it."""

    def _check_log_dir_exists(self) -> None:
        self.previous_rows = 0
        self._appending = self._fs.isfile(self.metrics_file_path)
        if not self._appending:
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
            reader = csv.reader(handle)
            header = next(reader, [])
            self.previous_rows = sum(1 for row in reader if row)
        self.metrics_keys = [k for k in header if k]  # the file's column order

    def _record_new_keys(self) -> set[str]:
        """Appending, new keys join after the file's columns. Lightning's writer sorts the
        column list at every save and appends rows in that order, under a header in another
        order when the file's columns are not sorted (every value of a row under another
        column). A new file: Lightning's (sorted)."""
        if not self._appending:
            return super()._record_new_keys()
        new_keys = set().union(*self.metrics) - set(self.metrics_keys)
        self.metrics_keys.extend(sorted(new_keys))
        return new_keys

    def set_aside_steps_from(self, step: int, name: str = REPLAYED_FILE) -> int:
        """Move the earlier runs' rows logged at global step ``step`` or later out of
        ``metrics.csv`` into ``name`` (appended, same columns): the steps a run killed
        after its last checkpoint had logged, which this run (resumed from that checkpoint,
        at ``step``) trains and logs again. Rows this run logged are not touched. Returns
        how many rows moved."""
        if not self.previous_rows or not self._fs.isfile(self.metrics_file_path):
            return 0
        with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
            reader = csv.DictReader(handle)
            columns = list(reader.fieldnames or [])
            rows = list(reader)
        earlier, ours = rows[:self.previous_rows], rows[self.previous_rows:]
        stale = [(s := _step_of(r)) is not None and s >= step for r in earlier]
        moved = [r for r, out in zip(earlier, stale, strict=True) if out]
        if not moved:
            return 0
        kept = [r for r, out in zip(earlier, stale, strict=True) if not out]
        aside = f"{self.log_dir}/{name}"
        new_file = not self._fs.isfile(aside)
        with self._fs.open(aside, "a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            if new_file:
                writer.writeheader()
            writer.writerows(moved)
        with self._fs.open(self.metrics_file_path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows([*kept, *ours])
        self.previous_rows = len(kept)
        return len(moved)


class CSVLogger(_LightningCSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that appends to ``<save_dir>/<name>/<version>/
    metrics.csv`` when it exists (a run resumed into its own folder keeps the rows it
    logged before the interruption), instead of deleting it. Same arguments as Lightning's.

    A run resumed from a checkpoint at global step ``G`` sets aside the earlier rows of
    steps ``G`` and later (:meth:`set_aside_steps_from`, called by
    :class:`~remat.callbacks.ResumeState`): a run killed without its own checkpoint
    (SIGKILL, out of memory) had logged steps past its last checkpoint, which the resumed
    run trains again, and ``metrics.csv`` would list those steps twice.
    """

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def set_aside_steps_from(self, step: int) -> int:
        """Move the earlier runs' rows of global step ``step`` and later from
        ``metrics.csv`` to ``metrics.replayed.csv`` beside it; returns how many moved."""
        self.save()  # rows of this run still buffered go to the file first
        return self.experiment.set_aside_steps_from(step)
