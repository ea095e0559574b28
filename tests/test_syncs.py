"""The host-sync counter (mptrain.syncs) sees every kind of read-back, and nothing else."""

from __future__ import annotations

import torch

from mptrain.syncs import count_host_syncs


def test_counts_each_kind_of_read_back_with_its_call_site() -> None:
    t = torch.arange(4.0)
    with count_host_syncs() as c:
        t.sum().item()
        bool(t.sum() > 0)
        t.tolist()
        float(t.max())
        t.nonzero()
    assert dict(c.by_kind) == {"item": 2, "bool": 1, "tolist": 1, "nonzero": 1}
    assert c.total == 5
    assert "tests/test_syncs.py:" in c.report()


def test_device_work_alone_makes_no_sync() -> None:
    t = torch.randn(64, 64)
    with count_host_syncs() as c:
        y = (t @ t).relu().amax()
        torch.where(y > 0, t, 0.0).mul_(2)
        t.to(torch.float16)  # a dtype cast is no device transfer
    assert c.total == 0, c.report()


def test_nothing_is_counted_outside_the_block() -> None:
    with count_host_syncs() as c:
        pass
    torch.ones(2).sum().item()
    assert c.total == 0
