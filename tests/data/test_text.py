"""Text datamodules: the real tiny Shakespeare corpus, tiny corpora in tmp files, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from remat.config import config_dir
from remat.data import ByteTextDataModule, CharTextDataModule, TokenWindows

CONFIGS = config_dir() / "data"
SHAKESPEARE_BYTES = 1_115_394  # SOURCE.md of the copy


@pytest.fixture(scope="module")
def shakespeare(shakespeare_root: Path) -> CharTextDataModule:
    cfg = OmegaConf.load(CONFIGS / "tinyshakespeare.yaml")
    cfg.root = str(shakespeare_root)
    dm = instantiate(cfg, block_size=64, batch_size=4, val_windows=8, train_windows=20)
    dm.setup("fit")
    return dm


def _write(tmp_path: Path, text: str, name: str = "input.txt") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text, encoding="utf-8")
    return tmp_path


# ------------------------------------------------------------------------------ real corpus


def test_shakespeare_vocabulary_split_and_round_trip(shakespeare, shakespeare_root):
    text = (shakespeare_root / "input.txt").read_text(encoding="utf-8")
    assert len(text) == SHAKESPEARE_BYTES
    assert shakespeare.vocab_size == 65
    assert shakespeare.chars == "".join(sorted(set(text)))
    assert shakespeare.chars[0] == "\n" and shakespeare.chars[1] == " "
    # contiguous 90/10 split: 1,003,854 train characters as in nanoGPT's shakespeare_char
    assert shakespeare.train_set.tokens.numel() == 1_003_854
    assert shakespeare.val_set.dataset.tokens.numel() == SHAKESPEARE_BYTES - 1_003_854
    assert shakespeare.decode(shakespeare.val_set.dataset.tokens[:30]) == text[1_003_854:][:30]
    assert shakespeare.decode(shakespeare.encode(text[:500])) == text[:500]


def test_shakespeare_batches_are_shifted_windows(shakespeare, shakespeare_root):
    text = (shakespeare_root / "input.txt").read_text(encoding="utf-8")
    batch = next(iter(shakespeare.train_dataloader()))["tokens"]
    assert batch.dtype == torch.int64 and batch.shape == (4, 65)
    for row in batch:  # each window is a piece of the training text, inputs + next char
        assert shakespeare.decode(row) in text[:1_003_854]
    assert len(shakespeare.train_dataloader()) == 5  # 20 windows / batch 4
    val = [b["tokens"] for b in shakespeare.val_dataloader()]
    assert len(val) == 2 and all(b.shape == (4, 65) for b in val)
    # validation windows are fixed: non-overlapping, in order, the same every epoch
    assert shakespeare.decode(val[0][1]) == text[1_003_854 + 64:1_003_854 + 129]
    again = [b["tokens"] for b in shakespeare.val_dataloader()]
    assert all(torch.equal(a, b) for a, b in zip(val, again, strict=True))


def test_train_windows_are_random_but_seeded(shakespeare):
    first = torch.cat([b["tokens"] for b in shakespeare.train_dataloader()])
    second = torch.cat([b["tokens"] for b in shakespeare.train_dataloader()])
    assert torch.equal(first, second)  # a fresh loader replays the seeded order
    assert len({tuple(row.tolist()) for row in first}) == 20  # distinct: no replacement


# ------------------------------------------------------------------------------ tmp corpora


def test_char_datamodule_on_a_tmp_file(tmp_path):
    root = _write(tmp_path, "abcab" * 40)  # 200 chars: 180 train / 20 val
    dm = CharTextDataModule(root, block_size=9, batch_size=2)
    dm.setup("fit")
    assert dm.chars == "abc" and dm.vocab_size == 3
    assert dm.train_set.tokens.tolist()[:6] == [0, 1, 2, 0, 1, 0]
    assert len(dm.train_set) == 180 - 10 + 1  # every offset
    assert len(dm.val_set) == 2  # windows at 0 and 9: each val char is predicted once
    assert len(dm.train_dataloader()) == 180 // 9 // 2  # default: one pass worth of chars


def test_vocabulary_survives_state_dict_round_trip(tmp_path):
    dm = CharTextDataModule(_write(tmp_path / "a", "hello world\n" * 20), block_size=8)
    dm.setup("fit")
    saved = dm.state_dict()
    assert saved["vocab"] == "\n dehlorw"
    # a resumed run on a corpus with fewer characters keeps the saved ids
    other = CharTextDataModule(_write(tmp_path / "b", "hello\n" * 40), block_size=8)
    other.setup("fit")
    assert other.vocab_size == 5
    other.load_state_dict(saved)
    assert other.vocab_size == 9 and other.chars == saved["vocab"]
    assert other.encode("hello").tolist() == dm.encode("hello").tolist() == [4, 3, 5, 5, 6]
    assert other.train_set.tokens[:6].tolist() == [4, 3, 5, 5, 6, 0]
    # loaded before setup (Lightning may restore first): setup uses the saved vocabulary
    early = CharTextDataModule(tmp_path / "b", block_size=8)
    early.load_state_dict(saved)
    early.setup("fit")
    assert early.chars == saved["vocab"]


def test_resuming_with_a_character_missing_from_the_saved_vocabulary_fails(tmp_path):
    saved = {"vocab": "\n abc", "file": "old.txt"}
    dm = CharTextDataModule(_write(tmp_path, "abc abc\nabz#c\n" * 20), block_size=8)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"2 character\(s\) missing.*'#' \(U\+0023\), 'z'") as err:
        dm.load_state_dict(saved)
    assert str(tmp_path / "input.txt") in str(err.value)


def test_block_size_longer_than_a_split_names_the_split(tmp_path):
    root = _write(tmp_path, "x" * 100)  # 90 train / 10 val characters
    with pytest.raises(ValueError, match=r"data.block_size=20 .* val split of .*input.txt has "
                                         r"only 10 tokens"):
        CharTextDataModule(root, block_size=20).setup("fit")
    with pytest.raises(ValueError, match=r"data.block_size=95 .* train split .* only 90"):
        CharTextDataModule(root, block_size=95).setup("fit")


def test_missing_empty_or_unset_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"text corpus not found: .*nowhere/input.txt "
                                                r"\(data.root="):
        CharTextDataModule(tmp_path / "nowhere").setup("fit")
    (tmp_path / "input.txt").write_text("")
    with pytest.raises(ValueError, match=r"input.txt is empty"):
        CharTextDataModule(tmp_path).setup("fit")
    with pytest.raises(ValueError, match="data.root is not set"):
        CharTextDataModule(None).setup("fit")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe" * 100)
    with pytest.raises(ValueError, match="not valid UTF-8.*data=enwik8"):
        CharTextDataModule(tmp_path, file="bin.txt").setup("fit")


def test_vocab_size_key_must_match_the_corpus(tmp_path):
    with pytest.raises(ValueError, match=r"data.vocab_size=65 but .*input.txt has 3 distinct "
                                         r"characters; set data.vocab_size=3"):
        dm = CharTextDataModule(_write(tmp_path, "abc" * 50), block_size=4, vocab_size=65)
        dm.setup("fit")
        dm.train_dataloader()
    dm.load_state_dict({"vocab": "abcdefgh"})  # a resumed run: the saved vocabulary counts
    with pytest.raises(ValueError, match=r"saved vocabulary has 8 distinct characters; set "
                                         r"data.vocab_size=8"):
        dm.val_dataloader()
    dm.load_state_dict({"vocab": "abc" + "".join(map(chr, range(62)))})
    assert dm.vocab_size == 65 and len(dm.train_dataloader()) > 0


def test_byte_datamodule_splits_and_decodes(tmp_path):
    data = bytes(range(256)) * 4 + "é".encode() * 8  # 1040 bytes
    (tmp_path / "enwik8").write_bytes(data)
    dm = ByteTextDataModule(tmp_path, block_size=16, batch_size=4)
    dm.setup("fit")
    assert dm.vocab_size == 256
    assert dm.split_sizes(1040) == (936, 52, 52)
    assert dm.train_set.tokens.numel() == 936 and dm.val_set.tokens.numel() == 52
    assert dm.test_set.tokens.tolist() == list(data[988:])
    test = next(iter(dm.test_dataloader()))["tokens"]
    assert test[0].tolist() == list(data[988:1005])
    assert dm.decode(dm.encode("naïve ☃")) == "naïve ☃"
    assert dm.decode([0xC3]) == "\ufffd"  # a cut UTF-8 sequence decodes, replaced


def test_enwik8_standard_split_for_files_of_1e8_bytes():
    assert ByteTextDataModule.split_sizes(100_000_000) == (90_000_000, 5_000_000, 5_000_000)
    assert ByteTextDataModule.split_sizes(100_000_123) == (90_000_000, 5_000_000, 5_000_000)
    assert ByteTextDataModule.split_sizes(99_999_999) == (90_000_001, 4_999_999, 4_999_999)


def test_enwik8_config_instantiates_and_rejects_other_vocab_sizes(tmp_path):
    cfg = OmegaConf.load(CONFIGS / "enwik8.yaml")
    cfg.root = str(tmp_path)
    (tmp_path / "enwik8").write_bytes(b"abcdefgh" * 200)
    dm = instantiate(cfg, block_size=8)
    dm.setup("fit")
    assert isinstance(dm, ByteTextDataModule) and len(dm.val_set) == (80 - 9) // 8 + 1
    with pytest.raises(Exception, match="data.vocab_size must be 256") as err:
        instantiate(cfg, vocab_size=65)
    assert isinstance(err.value.__cause__, ValueError)


def test_token_windows_index_errors():
    windows = TokenWindows(torch.arange(10), block_size=4, stride=2, split="val", source="x")
    assert len(windows) == 3 and windows[2]["tokens"].tolist() == [4, 5, 6, 7, 8]
    with pytest.raises(IndexError):
        windows[3]
