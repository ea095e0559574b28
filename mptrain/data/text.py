"""Token streams for language models: ``build_text_data(cfg.data, ...)`` returns a ``TextData``.

Datasets (``data.name``):

- ``synthetic_text``: a random stream made from the seed, no files. ``data.text_pattern=phrases``
  (default) concatenates fixed random 8-token phrases in random order, so there is something to
  learn (ideal perplexity about ``(vocab_size / 8) ** (1 / 8)``); ``uniform`` draws i.i.d. tokens
  (perplexity cannot fall below ``vocab_size``: a pure benchmark).
- ``text_corpus``: the PTB/WikiText layout, ``train.txt``, ``valid.txt`` and ``test.txt`` in
  ``data.root`` (``ptb.train.txt`` and ``wiki.train.tokens`` are found too). Files are
  pre-tokenized: words split on whitespace, every line ends with ``<eos>``. The vocabulary is
  built from train (the ``data.vocab_size`` most frequent words, or all), with ``<unk>`` for
  anything else; ``test`` is never read (evaluation uses ``valid``).
- ``python_docs``: a small real English corpus that needs no download: the Python Language
  Reference as shipped with CPython in ``pydoc_data.topics`` (the text behind ``help("if")``),
  lowercased and tokenized into words and punctuation, one paragraph per line, paragraphs split
  90/5/5 into train/valid/test. Its size depends on the Python version (about 100K tokens).

Batches for truncated BPTT: the split's stream is cut into ``data.batch_size`` contiguous rows (the
PTB "batchify"), and batch ``i`` is columns ``[i * bptt, (i + 1) * bptt)`` of those rows, targets
shifted by one token. Row ``r`` of batch ``i + 1`` continues row ``r`` of batch ``i``, which is
what lets the model carry its hidden state across batches. Every epoch reads the same stream in
the same order, so ``train_batches(epoch, start)`` is exact at any (epoch, start). With
``world_size`` > 1 the stream is cut into ``world_size * batch_size`` rows and each rank takes its
own ``batch_size`` of them.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from mptrain.data.base import check_rank, check_start, mix_seed
from mptrain.errors import MptrainError

__all__ = ["TEXT_DATASETS", "TextBatch", "TextData", "Vocab", "build_text_data"]

TEXT_DATASETS = ("synthetic_text", "text_corpus", "python_docs")
TextBatch = tuple[Tensor, Tensor]  # (inputs, targets), both int64 [batch, bptt]

UNK, EOS = "<unk>", "<eos>"
PHRASE_LEN = 8  # synthetic_text=phrases: tokens per phrase
_TRAIN, _VAL, _PHRASES = 0, 1, 2  # stream tags mixed into the seeds
# File names tried for each split of text_corpus, in order (PTB/WikiText variants).
_SPLIT_PATTERNS = ("{split}.txt", "*.{split}.txt", "*.{split}.tokens")


# --------------------------------------------------------------------------------------------
# vocabulary


@dataclass(frozen=True)
class Vocab:
    """Token strings by id; ``<unk>`` is id 0 and ``<eos>`` id 1."""

    tokens: tuple[str, ...]

    @classmethod
    def build(cls, counts: Counter[str], max_size: int | None) -> Vocab:
        """The specials, then words by falling count (ties: first seen first, so deterministic)."""
        words = [w for w, _ in counts.most_common() if w not in (UNK, EOS)]
        if max_size is not None:
            words = words[: max(max_size - 2, 0)]
        return cls((UNK, EOS, *words))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def index(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}

    def encode(self, lines: Iterable[list[str]]) -> tuple[Tensor, int]:
        """One int64 stream for ``lines`` of tokens (each followed by ``<eos>``), and its <unk> count."""
        index = self.index
        out = array("q")
        unknown = 0
        for words in lines:
            ids = [index.get(w, 0) for w in words]
            unknown += ids.count(0) - words.count(UNK)  # a literal <unk> in the text is not OOV
            out.extend(ids)
            out.append(1)
        return torch.frombuffer(out, dtype=torch.int64).clone() if out else torch.zeros(0, dtype=torch.int64), unknown

    def digest(self) -> str:
        """A short fingerprint: a checkpoint is only resumed with the vocabulary it was trained on."""
        return hashlib.sha256("\n".join(self.tokens).encode()).hexdigest()[:16]

    def save(self, path: Path, source: str) -> None:
        data = {"source": source, "size": len(self), "unk": UNK, "eos": EOS, "tokens": list(self.tokens)}
        path.write_text(json.dumps(data, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------
# batches


def batchify(stream: Tensor, rows: int, rank: int, world_size: int, what: str, key: str = "data.batch_size") -> Tensor:
    """This rank's ``[rows, n]`` block of the stream cut into ``world_size * rows`` contiguous rows."""
    total = rows * world_size
    n = stream.numel() // total
    if n < 2:  # one input token and its target at the very least
        where = f" per rank ({world_size} ranks)" if world_size > 1 else ""
        raise MptrainError(
            f"{key}={rows}: the {what} stream ({stream.numel()} tokens) is too short for "
            f"{rows} rows of at least 2 tokens{where}; use a smaller {key}"
        )
    return stream[: n * total].view(total, n)[rank * rows : (rank + 1) * rows]


class TextData:
    """Batches of a tokenized train/valid pair for truncated BPTT (see the module docstring).

    ``train_batches`` and ``val_batches`` yield ``(inputs, targets)``, int64 ``[B, T]`` on the
    device; training batches all have ``T = data.bptt``, the last validation batch may be shorter
    so that every validation token is scored once.
    """

    def __init__(
        self,
        *,
        name: str,
        train: Tensor,
        val: Tensor,
        vocab_size: int,
        vocab: Vocab | None,
        batch_size: int,
        val_batch_size: int,
        bptt: int,
        max_val_batches: int | None,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        info: dict[str, Any] | None = None,
    ) -> None:
        check_rank(rank, world_size)
        self.name = name
        self.vocab_size = vocab_size
        self.vocab = vocab
        self.bptt = bptt
        self.batch_size = batch_size
        self.train_size = train.numel()
        self.val_size = val.numel()
        self.info = info or {}
        self._train = batchify(train, batch_size, rank, world_size, "training").to(device)
        val_key = "data.val_batch_size" if val_batch_size != batch_size else "data.batch_size"
        self._val = batchify(val, val_batch_size, rank, world_size, "validation", val_key).to(device)
        self._steps = (self._train.shape[1] - 1) // bptt
        if self._steps < 1:
            raise MptrainError(
                f"data.bptt={bptt}: longer than the {self._train.shape[1] - 1} tokens per row of the "
                f"training stream (data.batch_size={batch_size}); use a smaller data.bptt or batch size"
            )
        starts = list(range(0, self._val.shape[1] - 1, bptt))
        self._val_starts = starts if max_val_batches is None else starts[:max_val_batches]

    def steps_per_epoch(self) -> int:
        return self._steps

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[TextBatch]:
        """Batches ``start, start + 1, ...`` of the epoch; every epoch reads the stream in order."""
        check_start(start, self._steps)
        t, data = self.bptt, self._train
        return ((data[:, i * t : (i + 1) * t], data[:, i * t + 1 : (i + 1) * t + 1]) for i in range(start, self._steps))

    def val_batches(self) -> Iterator[TextBatch]:
        data, n = self._val, self._val.shape[1]
        for s in self._val_starts:
            e = min(s + self.bptt, n - 1)
            yield data[:, s:e], data[:, s + 1 : e + 1]

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "train_tokens": self.train_size,
            "val_tokens": self.val_size,
            "bptt": self.bptt,
            "steps_per_epoch": self._steps,
            **self.info,
        }


# --------------------------------------------------------------------------------------------
# synthetic_text


def synthetic_streams(
    vocab_size: int, train_tokens: int, val_tokens: int, pattern: str, seed: int
) -> tuple[Tensor, Tensor]:
    """``(train, val)`` int64 streams drawn from ``seed`` (on the CPU, so any device gets the same)."""
    g = torch.Generator().manual_seed(mix_seed(seed, _PHRASES))
    if pattern == "uniform":
        draw = [torch.randint(vocab_size, (n,), generator=g.manual_seed(mix_seed(seed, split)))
                for split, n in ((_TRAIN, train_tokens), (_VAL, val_tokens))]
        return draw[0], draw[1]
    if pattern != "phrases":
        raise MptrainError(f"data.text_pattern={pattern!r}: must be one of phrases, uniform")
    # About vocab_size / PHRASE_LEN phrases: each token occurs in about one phrase, so the next token
    # is nearly determined once the model knows which phrase it is in and where.
    table = torch.randint(vocab_size, (max(2, vocab_size // PHRASE_LEN), PHRASE_LEN), generator=g)
    out = []
    for split, n in ((_TRAIN, train_tokens), (_VAL, val_tokens)):
        g.manual_seed(mix_seed(seed, split))
        ids = torch.randint(table.shape[0], (-(-n // PHRASE_LEN),), generator=g)
        out.append(table[ids].flatten()[:n])
    return out[0], out[1]


# --------------------------------------------------------------------------------------------
# text_corpus


def find_split(root: Path, split: str) -> Path:
    """The one file of ``split`` (train | valid | test) in ``root``; a one-line error otherwise."""
    for pattern in _SPLIT_PATTERNS:
        found = sorted(p for p in root.glob(pattern.format(split=split)) if p.is_file())
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(p.name for p in found)
            raise MptrainError(f"data.root={root}: several {split} files ({names}); keep one")
    tried = ", ".join(p.format(split=split) for p in _SPLIT_PATTERNS)
    raise MptrainError(f"data.root={root}: no {split} split (looked for {tried})")


def read_lines(path: Path) -> list[list[str]]:
    """Whitespace-split lines; every line (blank ones too, as PTB/WikiText tools do) gets <eos>."""
    try:
        with path.open(encoding="utf-8") as f:
            return [line.split() for line in f]
    except UnicodeDecodeError as exc:
        raise MptrainError(f"data.root: {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise MptrainError(f"data.root: cannot read {path} ({exc.strerror})") from None


def corpus_streams(
    train_lines: list[list[str]], val_lines: list[list[str]], vocab_size: int | None, what: str
) -> tuple[Tensor, Tensor, Vocab, dict[str, Any]]:
    """Vocabulary from train, both splits encoded; info has the <unk> rates."""
    counts: Counter[str] = Counter(w for line in train_lines for w in line)
    if not counts:
        raise MptrainError(f"{what}: the training text has no words")
    vocab = Vocab.build(counts, vocab_size)
    train, train_unk = vocab.encode(train_lines)
    val, val_unk = vocab.encode(val_lines)
    info = {
        "train_unk_rate": train_unk / max(train.numel(), 1),
        "val_unk_rate": val_unk / max(val.numel(), 1),
        "vocab_digest": vocab.digest(),
    }
    return train, val, vocab, info


# --------------------------------------------------------------------------------------------
# python_docs

# Lowercased words (with inner apostrophes), numbers, and runs of one punctuation character
# ("**", "...", "::=") as single tokens.
_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)*|\d+|([^\sa-z\d])\1*")
_UNDERLINE = re.compile(r"^\s*([*=\-~^\"])\1{2,}\s*$")  # reST heading underlines: layout, not text


def python_docs_splits() -> tuple[list[list[str]], list[list[str]], list[list[str]], str]:
    """``(train, valid, test)`` tokenized paragraphs of ``pydoc_data.topics`` and a source line."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise MptrainError("data=python_docs: this Python has no pydoc_data module (a stripped install)") from None
    paragraphs: list[list[str]] = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(line for line in block.splitlines() if not _UNDERLINE.match(line))
            words = [m.group(0) for m in _TOKEN.finditer(text.lower().replace("\u2019", "'"))]
            if words:
                paragraphs.append(words)
    # Every 20th paragraph to valid, the next to test: both splits sample the whole reference.
    splits: tuple[list[list[str]], list[list[str]], list[list[str]]] = ([], [], [])
    for i, words in enumerate(paragraphs):
        splits[{18: 1, 19: 2}.get(i % 20, 0)].append(words)
    source = (
        f"pydoc_data.topics of Python {sys.version.split()[0]} ({len(topics)} topics of the Python "
        "Language Reference, as shown by help())"
    )
    return splits[0], splits[1], splits[2], source


# --------------------------------------------------------------------------------------------
# entry point


def build_text_data(
    cfg: DictConfig, *, device: torch.device, seed: int, rank: int = 0, world_size: int = 1
) -> TextData:
    """The ``data`` group's token streams, batched on ``device``.

    Reads ``data.``: name, batch_size, val_batch_size (null: batch_size), bptt, max_val_batches,
    vocab_size; synthetic_text also train_tokens, val_tokens, text_pattern; text_corpus also root.
    """
    name = str(cfg.name)
    if name == "custom":  # the user's datasets of independent sequences (mptrain.data.custom)
        from mptrain.data.custom import CustomTextData

        return CustomTextData(cfg, device=torch.device(device), seed=seed, rank=rank,  # type: ignore[return-value]
                              world_size=world_size)
    common: dict[str, Any] = {
        "batch_size": int(cfg.batch_size),
        "val_batch_size": int(cfg.val_batch_size or cfg.batch_size),
        "bptt": int(cfg.bptt),
        "max_val_batches": cfg.max_val_batches,
        "device": torch.device(device),
        "rank": rank,
        "world_size": world_size,
    }
    if name == "synthetic_text":
        if cfg.vocab_size is None:
            raise MptrainError("data=synthetic_text needs data.vocab_size (e.g. 10000)")
        size = int(cfg.vocab_size)
        train, val = synthetic_streams(size, int(cfg.train_tokens), int(cfg.val_tokens), str(cfg.text_pattern), seed)
        return TextData(name=name, train=train, val=val, vocab_size=size, vocab=None,
                        info={"text_pattern": str(cfg.text_pattern)}, **common)
    if name == "text_corpus":
        if cfg.root is None:
            raise MptrainError("data=text_corpus needs data.root=PATH (a folder with train.txt, valid.txt, test.txt)")
        root = Path(str(cfg.root)).expanduser()
        if not root.is_dir():
            raise MptrainError(f"data.root={cfg.root}: no such directory")
        train_path, val_path = find_split(root, "train"), find_split(root, "valid")
        train, val, vocab, info = corpus_streams(
            read_lines(train_path), read_lines(val_path), cfg.vocab_size, f"data.root={cfg.root}"
        )
        info["source"] = str(root)
        return TextData(name=name, train=train, val=val, vocab_size=len(vocab), vocab=vocab, info=info, **common)
    if name == "python_docs":
        train_lines, val_lines, _test, source = python_docs_splits()
        train, val, vocab, info = corpus_streams(train_lines, val_lines, cfg.vocab_size, "data=python_docs")
        info["source"] = source
        return TextData(name=name, train=train, val=val, vocab_size=len(vocab), vocab=vocab, info=info, **common)
    raise MptrainError(f"data.name={name!r}: unknown text dataset (allowed: {', '.join(TEXT_DATASETS)})")
