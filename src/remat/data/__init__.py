"""Datamodules: one per dataset, plus the procedural synthetic set.

Segmentation datamodules yield ``{"image": float32 [B, C, H, W], "mask": int64 [B, H, W]}``
batches (C = 3, or 1 for grey data with ``image_mode=grey``; val/test batches also carry
``"name"``, DRIVE adds ``"valid"``, its field of view) and expose ``num_classes`` (1 for binary
tasks), ``class_names`` and ``ignore_index``. Text datamodules yield
``{"tokens": int64 [B, block_size + 1]}`` and expose ``vocab_size``.

File-based datamodules check every file of the splits a stage reads before it runs
(``data.verify``) and raise :class:`DataCheckError` listing each bad file; a bad file met while
loading raises :class:`DataFileError` (both ``ValueError``).
"""

from remat.data.cvc_clinicdb import CVCClinicDBDataModule
from remat.data.deepglobe_road import DeepGlobeRoadDataModule
from remat.data.drive import DRIVEDataModule
from remat.data.dubai_aerial import DubaiAerialDataModule
from remat.data.folder import FolderSegDataModule
from remat.data.inria import InriaDataModule
from remat.data.io import DataFileError
from remat.data.isbi2012 import ISBI2012DataModule
from remat.data.isic2018 import ISIC2018DataModule
from remat.data.kvasir import KvasirSegDataModule, KvasirSegDataset
from remat.data.loveda import LoveDADataModule
from remat.data.massachusetts import MassachusettsBuildingsDataModule, MassachusettsRoadsDataModule
from remat.data.msd import MSDDataModule
from remat.data.synthetic import SyntheticSegDataModule, SyntheticSegDataset
from remat.data.text import ByteTextDataModule, CharTextDataModule, TokenWindows
from remat.data.verify import DataCheckError
from remat.data.volumes import VolumeFolderDataModule

__all__ = [
    "ByteTextDataModule",
    "CharTextDataModule",
    "CVCClinicDBDataModule",
    "DataCheckError",
    "DataFileError",
    "DeepGlobeRoadDataModule",
    "DRIVEDataModule",
    "DubaiAerialDataModule",
    "FolderSegDataModule",
    "InriaDataModule",
    "ISBI2012DataModule",
    "ISIC2018DataModule",
    "KvasirSegDataModule",
    "KvasirSegDataset",
    "LoveDADataModule",
    "MassachusettsBuildingsDataModule",
    "MSDDataModule",
    "MassachusettsRoadsDataModule",
    "SyntheticSegDataModule",
    "SyntheticSegDataset",
    "TokenWindows",
    "VolumeFolderDataModule",
]
