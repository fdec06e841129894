"""One benchmark model on the measuring device at a time (GUIDE.md sec. 4)."""

from __future__ import annotations

import torch


class DeviceSlot:
    """At most one benchmark model on the measuring device at a time (GUIDE.md sec. 4).

    With ``swap`` (default: on CUDA) models live on the host (CPU); :meth:`load` moves one
    in after moving the previous one out (its gradients dropped first) and emptying the
    CUDA cache, and :meth:`keep` stores gradient copies on the host. Without ``swap`` (the
    CPU, where there is nothing to move) models stay where they are and ``load`` only
    records which one runs. The three moves are methods (``_move_in``, ``_move_out``,
    ``_to_home``), so tests can stand in a fake device.

    Args:
        device: the measuring device.
        swap: move models in and out (default ``device.type == "cuda"``).
    """

    host = torch.device("cpu")

    def __init__(self, device: torch.device | str, swap: bool | None = None) -> None:
        self.device = torch.device(device)
        self.swap = self.device.type == "cuda" if swap is None else bool(swap)
        self.resident: torch.nn.Module | None = None

    @property
    def home(self) -> torch.device:
        """Where models wait between rows: the host with ``swap``, else the device."""
        return self.host if self.swap else self.device

    def load(self, model: torch.nn.Module) -> torch.nn.Module:
        """Make ``model`` the one on the device (moving the previous one out); returns it."""
        if self.resident is not model:
            self.unload()
            if self.swap:
                self._move_in(model)
            self.resident = model
        return model

    def unload(self) -> None:
        """Move the resident model back to the host (gradients dropped) and empty the
        allocator cache; a no-op without ``swap``."""
        model, self.resident = self.resident, None
        if model is None or not self.swap:
            return
        model.zero_grad(set_to_none=True)
        self._move_out(model)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def keep(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` where they may wait between rows (the host with ``swap``)."""
        return {k: self._to_home(v.detach()) for k, v in tensors.items()}

    def _move_in(self, model: torch.nn.Module) -> None:
        model.to(self.device)

    def _move_out(self, model: torch.nn.Module) -> None:
        model.to(self.host)

    def _to_home(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.home, copy=True)
