"""LightningModules and their networks."""

from remat.models.gpt import GPT
from remat.models.segmentation import SegmentationModule, build_smp_model
from remat.models.sequence import SequenceModule, warmup_cosine
from remat.models.vit_seg import ViTSegmenter

__all__ = ["GPT", "SegmentationModule", "SequenceModule", "ViTSegmenter", "build_smp_model",
           "warmup_cosine"]
