"""Fixtures the unit tests share."""

from __future__ import annotations

import pytest

from kvstore_server.disk.tier import DiskTier

MiB = 1 << 20


@pytest.fixture
def tiers(tmp_path):
    """make(capacity, directory, **kw) -> a DiskTier in tmp_path, closed after the test."""
    made = []

    def make(capacity=64 * MiB, directory=None, **kw) -> DiskTier:
        tier = DiskTier(str(directory or tmp_path / "disk"), capacity, **kw)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
