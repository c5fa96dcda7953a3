"""Fixtures of the installer tests: a local hub on 127.0.0.1 and fake NVML cards."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from installer.download import DownloadOptions
from tests.installer.hubserver import Hub

KIB = 1024


@pytest.fixture
def hub() -> Iterator[Hub]:
    server = Hub(token="hf_test_token")
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def fast_options() -> DownloadOptions:
    """Small parts and short timeouts so stalls and retries happen in milliseconds."""
    return DownloadOptions(
        parts=4,
        min_part_bytes=128 * KIB,
        chunk_bytes=16 * KIB,
        stall_timeout_s=0.3,
        connect_timeout_s=2.0,
        max_retries=4,
        backoff_base_s=0.02,
        backoff_max_s=0.2,
        free_margin_bytes=0,
        save_every_bytes=32 * KIB,
        save_interval_s=0.05,
        event_interval_s=0.02,
    )


def blob(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)
