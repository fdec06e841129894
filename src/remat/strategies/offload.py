"""``offload``: keep the saved activations of the stages in host memory instead of the device.

Tensors saved for backward go through ``torch.autograd.graph.save_on_cpu``: its pack hook
copies each one to host memory in the forward, its unpack hook copies it back in backward
(PyTorch documentation, "Autograd mechanics", hooks for saved tensors,
https://docs.pytorch.org/docs/stable/notes/autograd.html). Two modes:

``segments=None``
    Each stage runs under ``save_on_cpu``: every tensor it saves goes to host memory and
    nothing is recomputed. The stage's instance ``forward`` is patched (for an
    ``nn.ModuleList``, each block's), so ``state_dict`` keys stay the same.
``segments="full" | "sqrtn" | "every_k"``
    The chains are cut and checkpointed as that strategy does, and each checkpoint call runs
    under ``save_on_cpu``. Non-reentrant ``checkpoint`` saves its inputs as ordinary saved
    tensors, before it installs its own saved-tensor hooks for the inside of the segment; so
    the pack hook of a ``save_on_cpu`` entered *around* the call sees exactly the segment
    inputs (the boundaries), and the activations inside are dropped and recomputed as
    usual. Putting ``save_on_cpu`` in the checkpoint's ``context_fn`` forward context
    instead would do the opposite: the inputs are saved before that context is entered, and
    the context's hooks, being innermost, would take the inside activations away from the
    checkpoint (everything offloaded, nothing recomputed).

On a machine without CUDA, ``pin_memory`` is ignored: the tensors already live in host
memory, ``save_on_cpu`` keeps them as they are, and the wrapped model computes the same
function as without it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu

from remat.strategies.base import StrategyReport
from remat.strategies.every_k import EveryK
from remat.strategies.full import FullCheckpoint
from remat.strategies.segmented import _STRATEGY, SegmentStrategy, _patch, unpatch_all
from remat.strategies.sqrtn import SqrtN
from remat.strategies.stages import resolve_stages

SEGMENTS = ("full", "sqrtn", "every_k")


def _offloaded_forward(self: nn.Module, *args, **kwargs):
    """Replacement ``forward`` of a stage (or block) offloaded as a whole."""
    if not (self.training and torch.is_grad_enabled()):
        return type(self).forward(self, *args, **kwargs)
    with getattr(self, _STRATEGY).host_memory():
        return type(self).forward(self, *args, **kwargs)


class OffloadCheckpoint(SegmentStrategy):
    """Move the saved activations of the stages to host memory (``save_on_cpu``).

    Args:
        pin_memory: copy into page-locked host memory, so the copies run asynchronously on
            CUDA. Ignored when CUDA is not available.
        segments: ``None`` to offload everything each stage saves (no recompute); or
            ``"full"``, ``"sqrtn"``, ``"every_k"`` to checkpoint the chains as that
            strategy does and offload only the segment inputs (one per segment).
        k: blocks per segment for ``segments="every_k"``.

    Raises:
        ValueError: unknown ``segments`` (the message lists the valid ones), ``k < 1``, or a
            ``pin_memory`` that is not a bool.
    """

    name = "offload"

    def __init__(self, pin_memory: bool = True, segments: str | None = None,
                 k: int = 2) -> None:
        if not isinstance(pin_memory, bool):
            raise ValueError(f"strategy offload: pin_memory must be true or false, "
                             f"got {pin_memory!r}")
        if segments is not None and segments not in SEGMENTS:
            raise ValueError(f"strategy offload: unknown segments {segments!r}; valid: "
                             f"null (offload everything the stage saves), "
                             f"{', '.join(SEGMENTS)}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"strategy offload: k must be an int >= 1, got {k!r}")
        self.pin_memory = pin_memory
        self.segments = segments
        self.k = k
        self._segmenter: SegmentStrategy | None = (
            None if segments is None else EveryK(k) if segments == "every_k"
            else FullCheckpoint() if segments == "full" else SqrtN())

    def host_memory(self) -> save_on_cpu:
        """The ``save_on_cpu`` context this strategy runs its stages or segments under."""
        return save_on_cpu(pin_memory=self.pin_memory and torch.cuda.is_available())

    def segments_for(self, n: int) -> list[tuple[int, int]]:
        if self._segmenter is None:
            raise RuntimeError("strategy offload: segments=None does not cut chains")
        return self._segmenter.segments_for(n)

    def run_segment(self, blocks: list[nn.Module], x, *args, **kwargs):
        """Checkpoint one segment with its inputs packed to host memory."""
        with self.host_memory():
            return super().run_segment(blocks, x, *args, **kwargs)

    def apply(self, model: nn.Module, stages: Iterable[str]) -> StrategyReport:
        """Offload the stages (see the module docstring for the two modes).

        Raises:
            StageError: a stage matches nothing, or (with ``segments``) is not a chain.
        """
        if self._segmenter is not None:
            return super().apply(model, stages)
        resolved = resolve_stages(model, stages)
        unpatch_all(model)  # one strategy per model: replaces whatever was applied before
        for _, stage in resolved:
            targets = list(stage) if isinstance(stage, nn.ModuleList) else [stage]
            for module in targets:
                _patch(module, _offloaded_forward, None, self)
        # Nothing is recomputed in this mode, so no module is reported as wrapped.
        return StrategyReport(strategy=self.name, stages=[p for p, _ in resolved])
