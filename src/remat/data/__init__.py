"""Datamodules: one per dataset, plus the procedural synthetic set.

Every datamodule yields ``{"image": float32 [B, 3, H, W], "mask": int64 [B, H, W]}`` batches
and exposes ``num_classes`` (1 for binary tasks).
"""

from remat.data.kvasir import KvasirSegDataModule, KvasirSegDataset
from remat.data.synthetic import SyntheticSegDataModule, SyntheticSegDataset

__all__ = [
    "KvasirSegDataModule",
    "KvasirSegDataset",
    "SyntheticSegDataModule",
    "SyntheticSegDataset",
]
