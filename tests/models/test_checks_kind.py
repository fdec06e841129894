"""Model/data kind detection must not evaluate properties that need setup()."""

from remat.data.text import CharTextDataModule
from remat.models.checks import _kind


def test_text_datamodule_with_unset_vocab_is_a_sequence_source(shakespeare_root):
    dm = CharTextDataModule(root=str(shakespeare_root), vocab_size=None, block_size=32,
                            batch_size=2)
    assert _kind(dm) == "sequence"

