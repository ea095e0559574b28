"""Token streams for the language model: BPTT batching, exact resume, the PTB/WikiText layout on
real files, the vocabulary and its <unk> handling, the offline corpus, one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_job
from omegaconf import DictConfig, OmegaConf

from mptrain.cli import compose
from mptrain.config import validate
from mptrain.data import build_text_data
from mptrain.data.text import EOS, UNK, Vocab, batchify, python_docs_splits
from mptrain.errors import MptrainError

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CPU OpenMP's spin-waits make
    them many times slower: one thread keeps these tests fast and their timing stable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def text_cfg(name: str = "synthetic_text", **kw: object) -> DictConfig:
    base = {"name": name, "root": None, "batch_size": 4, "val_batch_size": None, "bptt": 5, "max_val_batches": None,
            "vocab_size": 40, "train_tokens": 1000, "val_tokens": 200, "text_pattern": "phrases"}
    return OmegaConf.create({**base, **kw})


def write_corpus(root, train: str, valid: str = "a b\n" * 4, test: str = "a\n") -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in (("train.txt", train), ("valid.txt", valid), ("test.txt", test)):
        (root / name).write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------------
# batching


def test_batches_are_contiguous_rows_with_shifted_targets():
    data = build_text_data(text_cfg(), device=CPU, seed=0)
    batches = list(data.train_batches(0))
    assert len(batches) == data.steps_per_epoch() == (1000 // 4 - 1) // 5
    x0, y0 = batches[0]
    x1, _ = batches[1]
    assert x0.shape == y0.shape == (4, 5) and x0.dtype == torch.int64
    assert torch.equal(y0[:, :-1], x0[:, 1:])  # targets are the next tokens
    assert torch.equal(y0[:, -1], x1[:, 0])  # row r of batch i+1 continues row r of batch i
    # The rows are contiguous pieces of the one stream (what the carried hidden state relies on).
    rows = torch.cat([x for x, _ in batches], dim=1)
    stream = torch.cat(list(rows))
    assert torch.equal(rows[1, :10], stream[rows.shape[1] : rows.shape[1] + 10])


def test_resume_at_any_batch_and_epoch_is_exact():
    data = build_text_data(text_cfg(), device=CPU, seed=3)
    full = list(data.train_batches(1))
    tail = list(data.train_batches(1, start=7))
    assert len(tail) == len(full) - 7
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full[7:], tail, strict=True))
    again = build_text_data(text_cfg(), device=CPU, seed=3)  # same seed, same stream
    assert torch.equal(next(again.train_batches(0))[0], full[0][0])
    other = build_text_data(text_cfg(), device=CPU, seed=4)
    assert not torch.equal(next(other.train_batches(0))[0], full[0][0])


def test_validation_scores_every_token_once_and_respects_max_val_batches():
    data = build_text_data(text_cfg(val_batch_size=3), device=CPU, seed=0)
    scored = sum(y.numel() for _, y in data.val_batches())
    per_row = 200 // 3
    assert scored == 3 * (per_row - 1)  # the last batch is shorter instead of dropped
    capped = build_text_data(text_cfg(val_batch_size=3, max_val_batches=2), device=CPU, seed=0)
    assert len(list(capped.val_batches())) == 2


def test_ranks_take_disjoint_rows():
    stream = torch.arange(48)
    a, b = batchify(stream, 2, 0, 2, "t"), batchify(stream, 2, 1, 2, "t")
    assert a.shape == b.shape == (2, 12)
    assert set(a.flatten().tolist()).isdisjoint(b.flatten().tolist())


def test_phrases_are_learnable_and_uniform_is_not():
    phrases = build_text_data(text_cfg(vocab_size=64, train_tokens=4000), device=CPU, seed=0)
    uniform = build_text_data(text_cfg(vocab_size=64, train_tokens=4000, text_pattern="uniform"), device=CPU, seed=0)

    def distinct_bigrams(d) -> int:
        s = torch.cat(list(torch.cat([x for x, _ in d.train_batches(0)], dim=1)))
        return len(set(zip(s[:-1].tolist(), s[1:].tolist(), strict=True)))

    # A phrase stream repeats a small set of transitions; an i.i.d. stream sees most of the 64^2.
    assert distinct_bigrams(phrases) < distinct_bigrams(uniform) / 2


def test_too_short_streams_are_one_line_errors():
    with pytest.raises(MptrainError, match=r"data.batch_size=600: .* too short"):
        build_text_data(text_cfg(batch_size=600), device=CPU, seed=0)
    with pytest.raises(MptrainError, match=r"data.bptt=400: longer than"):
        build_text_data(text_cfg(bptt=400), device=CPU, seed=0)


# --------------------------------------------------------------------------------------------
# text_corpus: the PTB / WikiText layout on real files


def test_corpus_vocabulary_unk_and_eos(tmp_path):
    write_corpus(tmp_path, "the cat sat\nthe dog <unk>\n\nthe end\n", valid="the cow sat\n")
    data = build_text_data(text_cfg("text_corpus", root=str(tmp_path), vocab_size=None, batch_size=1, bptt=2),
                           device=CPU, seed=0)
    vocab = data.vocab
    assert vocab.tokens[:3] == (UNK, EOS, "the")  # specials first, then by frequency
    assert set(vocab.tokens) == {UNK, EOS, "the", "cat", "sat", "dog", "end"}
    index = vocab.index
    # The blank line is an <eos> of its own.
    words = ["the", "cat", "sat", EOS, "the", "dog", UNK, EOS, EOS, "the", "end", EOS]
    assert data._train.flatten().tolist() == [index[w] for w in words]
    # "cow" is not in train: <unk> in valid, counted as out-of-vocabulary; the literal <unk> is not.
    assert data._val.flatten().tolist() == [index[w] for w in ("the", UNK, "sat", EOS)]
    assert data.info["val_unk_rate"] == pytest.approx(1 / 4) and data.info["train_unk_rate"] == 0


def test_corpus_vocab_size_keeps_the_most_frequent_words(tmp_path):
    write_corpus(tmp_path, "a a a b b c\n" * 5)
    data = build_text_data(text_cfg("text_corpus", root=str(tmp_path), vocab_size=4, batch_size=2, bptt=2),
                           device=CPU, seed=0)
    assert data.vocab.tokens == (UNK, EOS, "a", "b") and data.vocab_size == 4
    assert data.info["train_unk_rate"] == pytest.approx(5 / 35)  # the five c's


def test_corpus_finds_ptb_and_wikitext_file_names(tmp_path):
    (tmp_path / "ptb.train.txt").write_text("a b c d e f g h\n" * 4)
    (tmp_path / "ptb.valid.txt").write_text("a b c d\n" * 2)
    data = build_text_data(text_cfg("text_corpus", root=str(tmp_path), vocab_size=None, batch_size=2, bptt=3),
                           device=CPU, seed=0)
    assert data.train_size == 36 and data.val_size == 10
    wiki = tmp_path / "wiki"
    wiki.mkdir()
    (wiki / "wiki.train.tokens").write_text(" = Title = \n\n a b c \n" * 4)
    (wiki / "wiki.valid.tokens").write_text(" a b \n" * 4)
    assert build_text_data(text_cfg("text_corpus", root=str(wiki), batch_size=2, bptt=2), device=CPU, seed=0)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"valid.txt": "a\n"}, r"no train split \(looked for train.txt, \*.train.txt, \*.train.tokens\)"),
        ({"train.txt": "a b c\n"}, r"no valid split"),
        ({"train.txt": "\n\n", "valid.txt": "a\n"}, r"the training text has no words"),
        ({"train.txt": "a\n", "a.train.txt": "b\n", "valid.txt": "a\n"}, None),  # train.txt wins
        ({"x.train.txt": "a\n", "y.train.txt": "b\n", "valid.txt": "a\n"}, r"several train files"),
    ],
)
def test_corpus_layout_errors_are_one_line(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    cfg = text_cfg("text_corpus", root=str(tmp_path), batch_size=1, bptt=1)
    if message is None:
        build_text_data(cfg, device=CPU, seed=0)
        return
    with pytest.raises(MptrainError, match=message) as info:
        build_text_data(cfg, device=CPU, seed=0)
    assert "\n" not in str(info.value)


def test_corpus_that_is_not_utf8_is_a_one_line_error(tmp_path):
    write_corpus(tmp_path, "a b\n")
    (tmp_path / "train.txt").write_bytes(b"caf\xe9 au lait\n")
    with pytest.raises(MptrainError, match=r"train.txt is not UTF-8 text"):
        build_text_data(text_cfg("text_corpus", root=str(tmp_path)), device=CPU, seed=0)


def test_corpus_run_saves_vocab_json(tmp_path):
    root = tmp_path / "corpus"
    write_corpus(root, "the quick brown fox jumps over the lazy dog\n" * 30, valid="the lazy fox\n" * 10)
    run = tmp_path / "run"
    s = run_job(run, "model=lstm_lm_tiny", "data=text_corpus", f"data.root={root}", "data.batch_size=2",
                "data.val_batch_size=2", "data.bptt=5", "trainer.max_steps=2", "trainer.log_every=1")
    assert s["status"] == "completed" and s["data"] == "text_corpus"
    vocab = json.loads((run / "vocab.json").read_text())
    assert vocab["tokens"][:3] == [UNK, EOS, "the"] and vocab["size"] == len(vocab["tokens"]) == 10
    assert vocab["source"] == str(root)
    assert s["task"]["vocab_size"] == 10


def test_missing_corpus_root_is_rejected_before_any_work(tmp_path):
    with pytest.raises(MptrainError, match=r"data=text_corpus needs data\.root=PATH"):
        validate(compose(["model=lstm_lm_tiny", "data=text_corpus"]))
    with pytest.raises(MptrainError, match="no such directory"):
        validate(compose(["model=lstm_lm_tiny", "data=text_corpus", f"data.root={tmp_path / 'nope'}"]))


# --------------------------------------------------------------------------------------------
# python_docs: real English that ships with Python


def test_python_docs_is_real_english_and_deterministic():
    train, valid, test, source = python_docs_splits()
    assert "pydoc_data.topics" in source
    n_train = sum(len(p) for p in train)
    assert n_train > 50_000 and sum(len(p) for p in valid) > 2_000 and test
    counts: dict[str, int] = {}
    for words in train:
        for w in words:
            counts[w] = counts.get(w, 0) + 1
    top = sorted(counts, key=counts.get, reverse=True)[:20]  # type: ignore[arg-type]
    assert {"the", "of", "is", "a"} <= set(top)
    data = build_text_data(text_cfg("python_docs", vocab_size=None, batch_size=10, bptt=35), device=CPU, seed=0)
    again = build_text_data(text_cfg("python_docs", vocab_size=None, batch_size=10, bptt=35), device=CPU, seed=1)
    assert data.vocab.digest() == again.vocab.digest() and data.vocab_size > 1000
    assert 0 < data.info["val_unk_rate"] < 0.05


def test_vocab_digest_tells_vocabularies_apart():
    a = Vocab((UNK, EOS, "x", "y"))
    assert a.digest() == Vocab((UNK, EOS, "x", "y")).digest() != Vocab((UNK, EOS, "y", "x")).digest()
