"""Text corpora for language modelling: character-level and byte-level datamodules.

Both yield ``{"tokens": int64 [B, block_size + 1]}`` batches (inputs and next-token targets in
one window, as :class:`remat.models.SequenceModule` reads them) and expose ``vocab_size``,
``encode`` and ``decode``.

- :class:`CharTextDataModule`: one plain UTF-8 text file (e.g. tiny Shakespeare, Karpathy
  2015, ``input.txt``); the vocabulary is the sorted set of its characters, saved in the
  checkpoint (``state_dict``) so a resumed run keeps the same token ids. Contiguous 90/10
  train/val split, as nanoGPT's ``shakespeare_char`` preparation does.
- :class:`ByteTextDataModule`: any file read as bytes (vocabulary 256), e.g. enwik8 (the first
  10^8 bytes of an English Wikipedia XML dump, Hutter Prize). Files of at least 10^8 bytes get
  the standard 90M/5M/5M train/val/test split (Al-Rfou et al. 2019, arXiv 1808.04444, sec. 4;
  Dai et al. 2019, Transformer-XL); smaller files 90/5/5 percent.

Training draws random windows of ``block_size + 1`` tokens (every start offset is a window; an
epoch is ``train_windows`` of them, drawn without replacement by a seeded sampler); validation
and test use non-overlapping windows in order, so they are the same every epoch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler

from remat.data.base import SplitDataModule

ENWIK8_SPLIT_BYTES = (90_000_000, 5_000_000, 5_000_000)  # train, val, test (Al-Rfou et al.)
_SHOW = 10  # how many missing characters an error lists


class TokenWindows(Dataset):
    """Windows of ``block_size + 1`` tokens cut from a 1-D token tensor.

    Window ``i`` starts at token ``i * stride``; item ``i`` is ``{"tokens": int64
    [block_size + 1]}``.

    Raises:
        ValueError: the split is shorter than one window; the message names the split, its
            length and ``data.block_size``.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int, split: str,
                 source: str | Path) -> None:
        if block_size < 1 or stride < 1:
            raise ValueError(f"data.block_size ({block_size}) and the window stride ({stride}) "
                             "must be >= 1")
        if tokens.numel() < block_size + 1:
            raise ValueError(
                f"data.block_size={block_size} needs windows of {block_size + 1} tokens, but the "
                f"{split} split of {source} has only {tokens.numel()} tokens; lower "
                "data.block_size or use a longer corpus"
            )
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return (self.tokens.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.stride
        return {"tokens": self.tokens[start:start + self.block_size + 1].long()}


def _read_corpus(root: str | Path | None, file: str, kind: str) -> Path:
    """The corpus path ``root/file``; raises a clear error when it is unset, missing or empty."""
    if root is None or not str(root).strip():
        raise ValueError(f"data.root is not set for the {kind} corpus: pass data.root=/path/to/"
                         f"folder holding {file} (or set REMAT_DATA_DIR)")
    path = Path(root).expanduser() / file
    if not path.is_file():
        raise FileNotFoundError(f"{kind} corpus not found: {path} (data.root={root}, "
                                f"data.file={file}); see data/README.md for the expected layout")
    if path.stat().st_size == 0:
        raise ValueError(f"{kind} corpus {path} is empty (data.root / data.file)")
    return path


class _TextDataModule(SplitDataModule):
    """Shared part of the text datamodules: window datasets and the loaders over them."""

    def __init__(self, root: str | Path | None, file: str, block_size: int, batch_size: int,
                 num_workers: int, train_windows: int | None, val_windows: int | None,
                 seed: int, pin_memory: bool) -> None:
        super().__init__(batch_size, num_workers, pin_memory, seed)
        if block_size < 1:
            raise ValueError(f"data.block_size must be >= 1, got {block_size}")
        for key, value in (("train_windows", train_windows), ("val_windows", val_windows)):
            if value is not None and value < 1:
                raise ValueError(f"data.{key} must be >= 1 or null, got {value}")
        self.root = root
        self.file = file
        self.block_size = block_size
        self.train_windows = train_windows
        self.val_windows = val_windows
        self.path: Path | None = None
        self.test_set: Dataset | None = None

    def _make_sets(self, splits: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Train windows at every offset; val/test non-overlapping (stride ``block_size``)."""
        sets = {name: TokenWindows(tokens, self.block_size, 1 if name == "train"
                                   else self.block_size, name, self.path)
                for name, tokens in splits}
        self.train_set, self.val_set = sets["train"], sets["val"]
        self.test_set = sets.get("test")
        if self.val_windows is not None and self.val_windows < len(self.val_set):
            self.val_set = torch.utils.data.Subset(self.val_set, range(self.val_windows))

    def check_vocab_size(self) -> None:
        """Hook: raise when the vocabulary does not match ``data.vocab_size``."""

    def val_dataloader(self) -> DataLoader:
        self.check_vocab_size()
        return super().val_dataloader()

    def train_dataloader(self) -> DataLoader:
        """Random windows: ``train_windows`` per epoch (default: one pass worth of tokens,
        ``len(train split) // block_size``), without replacement, seeded by ``data.seed``."""
        if self.train_set is None:
            raise RuntimeError("call setup() before asking for a dataloader")
        self.check_vocab_size()
        count = self.train_windows or max(1, self.train_set.tokens.numel() // self.block_size)
        sampler = WindowSampler(RandomSampler(
            self.train_set, num_samples=count,
            generator=torch.Generator().manual_seed(self.loader_seed)))
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler,
                          drop_last=count > self.batch_size, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0, pin_memory=self.pin_memory)

    def test_dataloader(self) -> DataLoader:
        self.check_vocab_size()
        return self._loader(self.test_set if self.test_set is not None else self.val_set,
                            train=False)


class WindowSampler(Sampler):
    """The train windows of an epoch: ``inner``'s indices (a seeded ``RandomSampler`` with
    ``num_samples``), unchanged.

    Not a ``RandomSampler`` itself, on purpose: under DDP/FSDP Lightning replaces a
    ``RandomSampler`` by a ``DistributedSampler`` over the whole dataset (every possible
    window: an epoch 150x as long here), while any other sampler is split across the ranks
    (``DistributedSamplerWrapper``), so the ranks share the epoch's ``train_windows``.
    :class:`remat.callbacks.ResumeState`, which shards train loaders itself so that a resume
    inside an epoch is exact, follows the same rule.
    """

    def __init__(self, inner: RandomSampler) -> None:
        self.inner = inner
        self.generator = inner.generator  # ResumeState sets it back on resume

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


class CharTextDataModule(_TextDataModule):
    """Character-level language modelling on one UTF-8 text file.

    The vocabulary is the sorted set of the corpus's characters (65 for tiny Shakespeare);
    token id = position in that string. ``state_dict`` holds it, so Lightning saves it in the
    checkpoint and a resumed run (``ckpt_path``) re-encodes the corpus with the saved ids.

    Args:
        root: folder holding ``file``.
        file: corpus file name (``input.txt`` for tiny Shakespeare).
        block_size: tokens a model sees; windows hold ``block_size + 1``.
        batch_size, num_workers, pin_memory: loader settings.
        train_fraction: leading fraction of the text used for training (the rest is val).
        train_windows: random training windows per epoch (null: split length // block_size).
        val_windows: first n val windows only (null: all).
        vocab_size: expected vocabulary size (the model's ``vocab_size`` follows it), or null
            to accept what the corpus has.
        seed: seeds the training window sampler.

    Raises:
        ValueError: unset ``data.root``; empty file; bad sizes or fraction; ``block_size``
            longer than a split; ``vocab_size`` different from the vocabulary in use (raised
            by the loaders, after a checkpoint's vocabulary was restored).
        FileNotFoundError: the file does not exist.
        ValueError: resuming with a corpus holding characters missing from the saved
            vocabulary (the message names them and the file).
    """

    def __init__(self, root: str | Path | None, file: str = "input.txt", block_size: int = 256,
                 batch_size: int = 32, num_workers: int = 0, train_fraction: float = 0.9,
                 train_windows: int | None = None, val_windows: int | None = None,
                 vocab_size: int | None = None, seed: int = 0,
                 pin_memory: bool = False) -> None:
        super().__init__(root, file, block_size, batch_size, num_workers, train_windows,
                         val_windows, seed, pin_memory)
        if not 0.0 < train_fraction < 1.0:
            raise ValueError(f"data.train_fraction must be in (0, 1), got {train_fraction}")
        self.train_fraction = train_fraction
        self.expected_vocab_size = vocab_size
        self.chars: str | None = None
        self._saved_vocab = False
        self._text: str | None = None

    @property
    def vocab_size(self) -> int:
        """Number of token ids (distinct characters); ``data.vocab_size`` before ``setup``."""
        if self.chars is None:
            if self.expected_vocab_size is None:
                raise RuntimeError("vocab_size is known after setup() (data.vocab_size=null)")
            return self.expected_vocab_size
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """String -> token ids ``int64 [len(text)]``.

        Raises:
            ValueError: a character outside the vocabulary (named, with the corpus file).
        """
        self._require_vocab()
        stoi = {c: i for i, c in enumerate(self.chars)}
        missing = sorted(set(text) - stoi.keys())
        if missing:
            raise ValueError(f"characters {_describe(missing)} are not in the vocabulary of "
                           f"{self.path}")
        return torch.tensor([stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Token ids -> string."""
        self._require_vocab()
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return "".join(self.chars[i] for i in ids)

    def _require_vocab(self) -> None:
        if self.chars is None:
            raise RuntimeError("call setup() (or load_state_dict) before encode/decode")

    def setup(self, stage: str | None = None) -> None:
        """Read the corpus, build the vocabulary (unless one was loaded) and the windows."""
        if self.train_set is not None:
            return
        if self._text is None:
            self.path = _read_corpus(self.root, self.file, "text")
            try:
                self._text = self.path.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"text corpus {self.path} is not valid UTF-8 ({err}); use "
                                 "data=enwik8 for byte-level modelling") from err
        saved = self.chars is not None
        self._set_vocab(self.chars if saved else "".join(sorted(set(self._text))), saved)

    def _set_vocab(self, chars: str, saved: bool) -> None:
        missing = sorted(set(self._text) - set(chars))
        if missing:
            raise ValueError(
                f"the corpus {self.path} has {len(missing)} character(s) missing from the "
                f"vocabulary saved in the checkpoint: {_describe(missing)}. Resume with the "
                "corpus the checkpoint was trained on, or start a new run (no ckpt_path)"
            )
        self.chars = chars
        self._saved_vocab = saved
        ids = self.encode(self._text)
        ids = ids.to(torch.uint8 if len(chars) <= 256 else torch.int32)
        cut = int(self.train_fraction * ids.numel())  # floor, as nanoGPT does
        self._make_sets([("train", ids[:cut]), ("val", ids[cut:])])

    def check_vocab_size(self) -> None:
        """Compare the vocabulary in use (the corpus's, or the checkpoint's once restored) with
        ``data.vocab_size``; the loaders call this, i.e. after Lightning restored a checkpoint.

        Raises:
            ValueError: they differ; the message gives the value to set.
        """
        if self.expected_vocab_size is None or self.chars is None:
            return
        if len(self.chars) != self.expected_vocab_size:
            origin = "the checkpoint's saved vocabulary" if self._saved_vocab else f"{self.path}"
            raise ValueError(
                f"data.vocab_size={self.expected_vocab_size} but {origin} has "
                f"{len(self.chars)} distinct characters; set data.vocab_size={len(self.chars)} "
                "(the model's vocab_size follows it)"
            )

    def state_dict(self) -> dict[str, Any]:
        """``{"vocab": the characters in id order, "file": corpus path}`` (saved in checkpoints)."""
        return {"vocab": self.chars, "file": str(self.path) if self.path else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Adopt a saved vocabulary; after ``setup`` the corpus is re-encoded with it.

        Raises:
            ValueError: the corpus has characters the saved vocabulary lacks.
        """
        chars = state_dict.get("vocab")
        if not chars:
            return
        if self._text is None:  # before setup: setup() will use it
            self.chars = chars
            return
        self._set_vocab(chars, saved=True)


class ByteTextDataModule(_TextDataModule):
    """Byte-level language modelling on any file (vocabulary 256: token id = byte value).

    Split: the standard enwik8 90M/5M/5M bytes (train/val/test) when the file has at least
    10^8 bytes, else 90/5/5 percent, contiguous and in file order.

    Args:
        root, file: the corpus is ``root/file`` (``enwik8`` for enwik8).
        block_size, batch_size, num_workers, pin_memory, train_windows, val_windows, seed:
            as :class:`CharTextDataModule`.
        vocab_size: must be 256 (kept as a key so the model can interpolate it).

    Raises:
        ValueError: unset ``data.root``; empty file; ``vocab_size`` not 256; ``block_size``
            longer than a split (named, with its length).
        FileNotFoundError: the file does not exist.
    """

    def __init__(self, root: str | Path | None, file: str = "enwik8", block_size: int = 512,
                 batch_size: int = 16, num_workers: int = 0, train_windows: int | None = None,
                 val_windows: int | None = None, vocab_size: int = 256, seed: int = 0,
                 pin_memory: bool = False) -> None:
        super().__init__(root, file, block_size, batch_size, num_workers, train_windows,
                         val_windows, seed, pin_memory)
        if vocab_size != 256:
            raise ValueError(f"data.vocab_size must be 256 for byte-level data, got {vocab_size}")
        self.vocab_size = 256

    @staticmethod
    def split_sizes(total: int) -> tuple[int, int, int]:
        """Train/val/test byte counts for a file of ``total`` bytes (see class docstring)."""
        if total >= sum(ENWIK8_SPLIT_BYTES):
            return ENWIK8_SPLIT_BYTES
        val = test = int(math.floor(0.05 * total))
        return total - val - test, val, test

    def encode(self, text: str) -> torch.Tensor:
        """String -> its UTF-8 bytes as ids ``int64 [n_bytes]``."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Byte ids -> string (invalid UTF-8 sequences become U+FFFD)."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(ids).decode("utf-8", errors="replace")

    def setup(self, stage: str | None = None) -> None:
        """Read the file as bytes and cut the train/val/test windows."""
        if self.train_set is not None:
            return
        self.path = _read_corpus(self.root, self.file, "byte")
        data = torch.frombuffer(bytearray(self.path.read_bytes()), dtype=torch.uint8)
        n_train, n_val, n_test = self.split_sizes(data.numel())
        self._make_sets([("train", data[:n_train]), ("val", data[n_train:n_train + n_val]),
                         ("test", data[n_train + n_val:n_train + n_val + n_test])])


def _describe(chars: Sequence[str]) -> str:
    shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in chars[:_SHOW])
    return shown + (f" and {len(chars) - _SHOW} more" if len(chars) > _SHOW else "")
