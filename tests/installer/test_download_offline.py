"""A download on a PC with no network: refused at once (not after ~100 s of retries) in plain words, urllib3's text
and HF_ENDPOINT left out unless a mirror is in use. No traffic leaves the machine: the request fails in a stand-in."""

import time
from pathlib import Path

import pytest
import requests

from installer.download import Downloader, DownloadError, DownloadOptions, RemoteFile, plain_reason

URLLIB3 = (
    "HTTPSConnectionPool(host='huggingface.co', port=443): Max retries exceeded with url: /x/resolve/main/m.gguf "
    '(Caused by NameResolutionError("<urllib3.connection.HTTPSConnection object at 0x7f>: Failed to resolve '
    "'huggingface.co' ([Errno -3] Temporary failure in name resolution)\"))"
)


def test_the_reasons_are_words() -> None:
    assert plain_reason(requests.ConnectionError(URLLIB3)) == (
        "the server's name does not resolve (no network, or no DNS)"
    )
    assert plain_reason(requests.ConnectTimeout("x")) == "the connection timed out"
    assert plain_reason(requests.ConnectionError("refused")).startswith("the connection failed")


def test_offline_fails_at_once_and_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def no_network(self, session, remote):
        calls.append(remote.name)
        raise requests.ConnectionError(URLLIB3)

    monkeypatch.setattr(Downloader, "_head", no_network)
    d = Downloader(tmp_path, options=DownloadOptions(max_retries=6, backoff_base_s=1.0))
    t0 = time.monotonic()
    with pytest.raises(DownloadError) as got:
        d.download([RemoteFile("https://huggingface.co/x/resolve/main/m.gguf", "m.gguf")])
    assert time.monotonic() - t0 < 1.0 and calls == ["m.gguf"]  # no retries for a name that does not resolve
    text = str(got.value)
    assert "cannot reach huggingface.co for m.gguf: the server's name does not resolve" in text
    assert "Check this PC's network connection" in text
    assert "HTTPSConnectionPool" not in text and "HF_ENDPOINT" not in text
