"""The process's global random number generators (torch CPU and CUDA, numpy, Python's
``random``) as plain data, put back, or kept around a block of work.

A resumed run puts back the states its checkpoint kept (:class:`remat.callbacks.ResumeState`);
building a run's strategy before the model (``remat.train``: a budget is planned then, and
planning builds and traces models) must not change the weights the run then draws.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """The global RNG states (torch CPU and CUDA, numpy, Python ``random``) as tensors and
    ints only, so the checkpoint loads with ``torch.load(weights_only=True)``."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": {"version": int(version), "state": list(internal), "gauss": gauss},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` returned (CUDA states only where CUDA is present and
    the device count matches)."""
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Put torch's (CPU and CUDA), numpy's and Python's global RNG back as they were after
    the block, whatever it drew."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
