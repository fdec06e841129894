"""LightningModules and their networks."""

from remat.models.gpt import GPT
from remat.models.segmentation import SegmentationModule, build_smp_model
from remat.models.sequence import SequenceModule

__all__ = ["GPT", "SegmentationModule", "SequenceModule", "build_smp_model"]
