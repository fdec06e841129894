"""LightningModules and their networks."""

from remat.models.segmentation import SegmentationModule, build_smp_model

__all__ = ["SegmentationModule", "build_smp_model"]
