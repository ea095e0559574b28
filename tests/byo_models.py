"""A user's own models and datasets, as ``model=custom`` / ``data=custom`` import them (tests/test_byo.py)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset


def small_cnn(num_classes: int, width: int = 8) -> nn.Module:
    """(N, 3, H, W) -> (N, num_classes): the classifier contract."""
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, 2 * width, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes))


class TinyLM(nn.Module):
    """(N, T) tokens -> (N, T, V) logits, the head tied to the embedding: the language-model contract."""

    def __init__(self, vocab_size: int, dim: int = 32, head_size: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, head_size or vocab_size, bias=False)
        if head_size is None:
            self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def not_a_module() -> object:
    return {"layers": 3}


def too_many_logits(num_classes: int) -> nn.Module:
    return small_cnn(num_classes + 1)


class Images(Dataset):
    """Learnable images: class c is a bright channel c % 3 plus noise. ``bad_label`` replaces item 3's label."""

    def __init__(self, n: int, num_classes: int, size: int, seed: int, bad_label: int | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, num_classes, (n,), generator=g)
        self.images = torch.randn(n, 3, size, size, generator=g)
        self.images[torch.arange(n), self.labels % 3] += 2.0
        self.bad_label = bad_label

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        label = self.bad_label if (i == 3 and self.bad_label is not None) else int(self.labels[i])
        return self.images[i], label


def images(num_classes: int = 4, size: int = 16, n_train: int = 32, n_val: int = 8,
           bad_label: int | None = None) -> tuple[Dataset, Dataset]:
    return Images(n_train, num_classes, size, 0, bad_label), Images(n_val, num_classes, size, 1)


class Sequences(Dataset):
    """Independent token sequences of ``length`` tokens: runs of one repeated token (learnable)."""

    def __init__(self, n: int, vocab: int, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, vocab, (n, 1), generator=g).repeat(1, length)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Tensor:
        return self.rows[i]


def sequences(vocab: int = 40, length: int = 9, n_train: int = 32, n_val: int = 8) -> tuple[Dataset, Dataset]:
    return Sequences(n_train, vocab, length, 0), Sequences(n_val, vocab, length, 1)


def a_list() -> list[int]:
    return [1, 2, 3]
