"""Downloads against a real local HTTP server imitating the hub (resolve redirect + ranged storage host)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest

from installer import download as dl
from installer.catalog import CatalogEntry, CatalogFile
from installer.download import (
    DiskFullError,
    DownloadCancelled,
    Downloader,
    DownloadError,
    DownloadEvent,
    DownloadOptions,
    DownloadState,
    VerificationError,
    entry_files,
    hub_files,
    iter_download,
)
from tests.installer.conftest import KIB, blob
from tests.installer.hubserver import Hub

REPO = "owner/Model-GGUF"
TOKEN = "hf_test_token"
Usage = namedtuple("Usage", "total used free")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make(
    tmp_path: Path,
    hub: Hub,
    options: DownloadOptions,
    events: list[DownloadEvent] | None = None,
    **kw: object,
) -> Downloader:
    return Downloader(
        tmp_path / "models",
        endpoint=hub.url,
        token=kw.pop("token", TOKEN),  # type: ignore[arg-type]
        options=options,
        on_event=None if events is None else events.append,
        **kw,  # type: ignore[arg-type]
    )


def states(events: list[DownloadEvent]) -> list[DownloadState]:
    out: list[DownloadState] = []
    for e in events:
        if not out or out[-1] != e.state:
            out.append(e.state)
    return out


def test_multipart_gguf_with_token_verified_and_renamed(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    part1, part2 = blob(900 * KIB, 1), blob(300 * KIB, 2)
    hub.add(REPO, "Q4_K_M/M-Q4_K_M-00001-of-00002.gguf", part1)
    hub.add(REPO, "Q4_K_M/M-Q4_K_M-00002-of-00002.gguf", part2)
    events: list[DownloadEvent] = []
    d = make(tmp_path, hub, fast_options, events)
    files = hub_files(
        REPO, ["Q4_K_M/M-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/M-Q4_K_M-00002-of-00002.gguf"], endpoint=hub.url
    )
    paths = d.download(files)

    assert [p.name for p in paths] == ["M-Q4_K_M-00001-of-00002.gguf", "M-Q4_K_M-00002-of-00002.gguf"]
    assert paths[0].read_bytes() == part1 and paths[1].read_bytes() == part2
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [p.name for p in paths]  # no .part left
    # Ranged parts in parallel for the bigger file (4 parts of at least 128 KiB).
    ranges = {
        r.range for r in hub.requests if r.server == "storage" and r.method == "GET" and "00001" in r.path
    }
    assert len(ranges) == 4
    # The token reaches the hub and never the storage host it redirects to.
    assert all(r.authorization == f"Bearer {TOKEN}" for r in hub.requests if r.server == "hub")
    assert all(r.authorization is None for r in hub.requests if r.server == "storage")
    assert states(events)[0] == DownloadState.STARTING
    assert DownloadState.VERIFYING in states(events) and states(events)[-1] == DownloadState.DONE
    last = events[-1]
    assert last.all_done == last.all_total == len(part1) + len(part2)
    assert last.file_index == 1 and last.file_count == 2
    assert hub.served_bytes == len(part1) + len(part2)


def test_connection_cut_ten_times_resumes_to_the_right_sha(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    data = blob(1024 * KIB, 3)
    hub.add(REPO, "m.gguf", data, drops=[40 * KIB] * 10)
    events: list[DownloadEvent] = []
    (path,) = make(tmp_path, hub, fast_options, events).download(
        hub_files(REPO, ["m.gguf"], endpoint=hub.url)
    )
    assert sha(path.read_bytes()) == sha(data)
    retries = [e for e in events if e.state == DownloadState.RETRYING and e.message]
    assert len(retries) == 10 and all("connection" in e.message for e in retries)
    # Each cut resumes at its offset: at most one 16 KiB write per cut is fetched twice.
    assert hub.served_bytes <= len(data) + 10 * 16 * KIB


def test_stall_triggers_retry_with_exponential_backoff(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    data = blob(100 * KIB, 4)  # one part
    hub.add(REPO, "m.gguf", data, stalls=[0, 0, 0])
    events: list[DownloadEvent] = []
    opts = DownloadOptions(**{**fast_options.__dict__, "backoff_base_s": 0.1, "backoff_max_s": 1.0})
    started = time.monotonic()
    (path,) = make(tmp_path, hub, opts, events).download(hub_files(REPO, ["m.gguf"], endpoint=hub.url))
    elapsed = time.monotonic() - started
    assert path.read_bytes() == data
    stalled = [e for e in events if e.state == DownloadState.STALLED and e.message]
    retries = [e for e in events if e.state == DownloadState.RETRYING and e.message]
    assert len(stalled) == 3 and "no data for 0.3 s" in stalled[0].message
    assert [e.attempt for e in retries] == [1, 2, 3]
    assert [m.message.split(" in ")[-1] for m in retries] == ["0.1 s", "0.2 s", "0.4 s"]
    # Three stall timeouts plus 0.1 + 0.2 + 0.4 s of backoff.
    assert elapsed >= 3 * 0.3 + 0.7


def test_stalling_forever_gives_up_with_a_message(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    hub.add(REPO, "m.gguf", blob(64 * KIB, 5), stalls=[0] * 10)
    events: list[DownloadEvent] = []
    with pytest.raises(DownloadError, match=r"stalled 4 times in a row.*resumes where it stopped"):
        make(tmp_path, hub, fast_options, events).download(hub_files(REPO, ["m.gguf"], endpoint=hub.url))
    assert events[-1].state == DownloadState.FAILED
    assert not (tmp_path / "models" / "m.gguf").exists()


def test_flipped_byte_is_detected_and_fetched_again(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    data = blob(600 * KIB, 6)
    hub.add(REPO, "m.gguf", data, corrupt_offset=400 * KIB + 7, corrupt_times=1)
    events: list[DownloadEvent] = []
    (path,) = make(tmp_path, hub, fast_options, events).download(
        hub_files(REPO, ["m.gguf"], endpoint=hub.url)
    )
    assert path.read_bytes() == data
    again = [e for e in events if e.state == DownloadState.RETRYING and "sha256" in e.message]
    assert len(again) == 1 and "downloading it again" in again[0].message


def test_wrong_bytes_fail_and_nothing_is_at_the_final_name(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    data = blob(300 * KIB, 7)
    hub.add(REPO, "m.gguf", data, corrupt_offset=12345, corrupt_times=100)
    events: list[DownloadEvent] = []
    with pytest.raises(VerificationError, match="sha256 of m.gguf is .* expected " + sha(data)):
        make(tmp_path, hub, fast_options, events).download(hub_files(REPO, ["m.gguf"], endpoint=hub.url))
    assert events[-1].state == DownloadState.FAILED
    assert list((tmp_path / "models").iterdir()) == []


def test_cancel_then_a_new_downloader_resumes_from_the_saved_state(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    data = blob(2048 * KIB, 8)
    hosted = hub.add(REPO, "m.gguf", data, throttle_s=0.002)
    first: Downloader

    def on_event(e: DownloadEvent) -> None:
        if e.bytes_total and e.bytes_done > e.bytes_total // 2:
            first.cancel()

    first = Downloader(
        tmp_path / "models", endpoint=hub.url, token=TOKEN, options=fast_options, on_event=on_event
    )
    with pytest.raises(DownloadCancelled, match="resumes from here"):
        first.download(hub_files(REPO, ["m.gguf"], endpoint=hub.url))
    state = json.loads((tmp_path / "models" / "m.gguf.part.json").read_text())
    saved = sum(p["saved"] - p["start"] for p in state["parts"])
    assert saved > 0 and not (tmp_path / "models" / "m.gguf").exists()

    hosted.throttle_s = 0.0
    hub.reset_counters()
    events: list[DownloadEvent] = []
    (path,) = make(tmp_path, hub, fast_options, events).download(
        hub_files(REPO, ["m.gguf"], endpoint=hub.url)
    )
    assert path.read_bytes() == data
    assert hub.served_bytes == len(data) - saved  # exactly the bytes not recorded as on disk
    assert hub.served_bytes < len(data)


def test_killed_process_resumes_after_restart(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    data = blob(3072 * KIB, 9)
    hosted = hub.add(REPO, "m.gguf", data, throttle_s=0.02)
    dest = tmp_path / "models"
    script = textwrap.dedent(
        f"""
        from installer.download import Downloader, DownloadOptions, hub_files
        opts = DownloadOptions(**{fast_options.__dict__!r})
        Downloader({str(dest)!r}, endpoint={hub.url!r}, token={TOKEN!r}, options=opts).download(
            hub_files({REPO!r}, ["m.gguf"], endpoint={hub.url!r}))
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2])
    sidecar = dest / "m.gguf.part.json"
    saved = 0
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline and saved < len(data) // 3:
            time.sleep(0.02)
            try:
                saved = sum(p["saved"] - p["start"] for p in json.loads(sidecar.read_text())["parts"])
            except (OSError, ValueError):
                continue
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert saved >= len(data) // 3, "the child never got a third of the way"
    assert not (dest / "m.gguf").exists()

    hosted.throttle_s = 0.0
    hub.reset_counters()
    (path,) = make(tmp_path, hub, fast_options).download(hub_files(REPO, ["m.gguf"], endpoint=hub.url))
    assert path.read_bytes() == data
    assert (
        hub.served_bytes <= len(data) - saved + 4 * 32 * KIB
    )  # only what the kill left unrecorded, per part
    assert hub.served_bytes < len(data)


def test_free_disk_is_checked_before_the_first_byte(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    hub.add(REPO, "m.gguf", blob(500 * KIB, 10))
    d = make(tmp_path, hub, fast_options, disk_usage=lambda _p: Usage(10**12, 10**12 - 100 * KIB, 100 * KIB))
    with pytest.raises(DiskFullError, match=r"not enough free disk space in .*models.*free up space"):
        d.download(hub_files(REPO, ["m.gguf"], endpoint=hub.url))
    assert list((tmp_path / "models").iterdir()) == []
    assert not [r for r in hub.requests if r.server == "storage" and r.method == "GET"]


def test_disk_full_while_writing_stops_clearly_and_resumes_later(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = blob(800 * KIB, 11)
    hub.add(REPO, "m.gguf", data)
    written = {"n": 0}
    real = dl._write_chunk

    def filling(fh: object, chunk: bytes) -> None:
        if written["n"] >= 256 * KIB:
            raise OSError(errno.ENOSPC, "No space left on device")
        written["n"] += len(chunk)
        real(fh, chunk)

    monkeypatch.setattr(dl, "_write_chunk", filling)
    events: list[DownloadEvent] = []
    with pytest.raises(DiskFullError, match=r"the disk is full while writing .*m.gguf.part.*resumes"):
        make(tmp_path, hub, fast_options, events).download(hub_files(REPO, ["m.gguf"], endpoint=hub.url))
    assert events[-1].state == DownloadState.FAILED
    assert not (tmp_path / "models" / "m.gguf").exists()

    monkeypatch.setattr(dl, "_write_chunk", real)
    hub.reset_counters()
    (path,) = make(tmp_path, hub, fast_options).download(hub_files(REPO, ["m.gguf"], endpoint=hub.url))
    assert path.read_bytes() == data and hub.served_bytes < len(data)


def test_gated_and_missing_files_say_what_to_do(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    hub.add(REPO, "m.gguf", blob(10 * KIB, 12))
    with pytest.raises(DownloadError, match=r"HTTP 401.*set HF_TOKEN"):
        make(tmp_path, hub, fast_options, token=None).download(hub_files(REPO, ["m.gguf"], endpoint=hub.url))
    with pytest.raises(
        DownloadError, match=r"nope.gguf was not found \(HTTP 404\).*check the repo and file name"
    ):
        make(tmp_path, hub, fast_options).download(hub_files(REPO, ["nope.gguf"], endpoint=hub.url))


def test_token_and_endpoint_come_from_the_environment(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = blob(50 * KIB, 13)
    hub.add(REPO, "m.gguf", data)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    entry = CatalogEntry(
        id="m",
        display_name="M",
        family="m",
        quant="Q4_K_M",
        hf_repo=REPO,
        files=(CatalogFile("m.gguf", len(data), sha(data)),),
        size_bytes=len(data),
        size_exact=True,
        architecture="qwen3moe",
        layers=4,
        experts=8,
        experts_used=2,
        context=4096,
        geometry_facts={},
    )
    d = Downloader(tmp_path / "models", options=fast_options)
    (path,) = d.download_entry(entry)
    assert path.read_bytes() == data
    assert entry_files(entry)[0].url == f"{hub.url}/{REPO}/resolve/main/m.gguf"


def test_catalog_size_or_sha_that_differs_from_the_hub_is_refused(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    data = blob(50 * KIB, 14)
    hub.add(REPO, "m.gguf", data)
    url = f"{hub.url}/{REPO}/resolve/main/m.gguf"
    with pytest.raises(DownloadError, match="is 51200 bytes on the server but 51201 in the catalog"):
        make(tmp_path, hub, fast_options).download([dl.RemoteFile(url, "m.gguf", size=len(data) + 1)])
    with pytest.raises(DownloadError, match="catalog's sha256 differs from the hub's"):
        make(tmp_path, hub, fast_options).download([dl.RemoteFile(url, "m.gguf", sha256="0" * 64)])


def test_server_without_ranges(tmp_path: Path, hub: Hub, fast_options: DownloadOptions) -> None:
    small, big = blob(60 * KIB, 15), blob(600 * KIB, 16)
    hub.add(REPO, "small.gguf", small, ranges=False)
    hub.add(REPO, "big.gguf", big, ranges=False)
    hub.add(
        REPO, "cut.gguf", big, ranges=False, drops=[250 * KIB] * 6
    )  # the parts' first GETs, then two cuts
    (path,) = make(tmp_path, hub, fast_options).download(hub_files(REPO, ["small.gguf"], endpoint=hub.url))
    assert path.read_bytes() == small  # one part from byte 0: a plain 200 is the whole file
    # a file planned in parts goes on over one connection once the server answers a range with the whole file
    events: list[DownloadEvent] = []
    (path,) = make(tmp_path, hub, fast_options, events).download(
        hub_files(REPO, ["big.gguf"], endpoint=hub.url)
    )
    assert path.read_bytes() == big
    assert any("over one connection from the start" in e.message for e in events)
    # and a cut on that one connection starts it over from byte 0 (the server cannot resume)
    hub.reset_counters()
    (path,) = make(tmp_path, hub, fast_options).download(hub_files(REPO, ["cut.gguf"], endpoint=hub.url))
    assert path.read_bytes() == big
    gets = [r for r in hub.requests if r.server == "storage" and r.method == "GET" and "cut.gguf" in r.path]
    assert len(gets) >= 3 and not hub.files[f"{REPO}/cut.gguf"].drops  # both cuts happened, and were got over


def test_a_complete_file_is_not_fetched_again_and_events_iterate(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    data = blob(200 * KIB, 17)
    hub.add(REPO, "m.gguf", data)
    files = hub_files(REPO, ["m.gguf"], endpoint=hub.url)
    events = list(iter_download(make(tmp_path, hub, fast_options), files))
    assert events[-1].state == DownloadState.DONE and events[-1].bytes_done == len(data)
    assert any(e.state == DownloadState.DOWNLOADING for e in events)
    hub.reset_counters()
    again = list(iter_download(make(tmp_path, hub, fast_options), files))
    assert [e.state for e in again][-1] == DownloadState.DONE and again[-1].message == "already downloaded"
    assert not [r for r in hub.requests if r.server == "storage" and r.method == "GET"]


def test_a_stale_part_without_its_state_is_started_over(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    data = blob(300 * KIB, 18)
    hub.add(REPO, "m.gguf", data)
    dest = tmp_path / "models"
    dest.mkdir()
    (dest / "m.gguf.part").write_bytes(b"\0" * 1000)  # no sidecar: nothing on disk can be trusted
    (path,) = make(tmp_path, hub, fast_options).download(hub_files(REPO, ["m.gguf"], endpoint=hub.url))
    assert path.read_bytes() == data and hub.served_bytes == len(data)
    assert sorted(os.listdir(dest)) == ["m.gguf"]


def test_a_disk_that_fills_while_the_state_is_saved_is_a_disk_full_error(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reported case: the progress record's write hit ENOSPC and escaped as a raw OSError, the part threads
    kept running and a .part.json.tmp stayed. Now: DiskFullError with the free space and the size, the threads
    stopped, no stray file."""
    import threading

    data = blob(1024 * KIB, 9)
    hub.add(REPO, "m.gguf", data, throttle_s=0.002)
    real = Path.write_text
    writes = []

    def full_disk(self: Path, text: str, *a: object, **k: object) -> int:
        if self.name.endswith(".part.json.tmp"):
            writes.append(self)
            if len(writes) > 1:  # the first record is written, the disk fills during the download
                real(self, text[: len(text) // 2], encoding="utf-8")
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", full_disk)
    before = threading.active_count()
    with pytest.raises(DiskFullError, match=r"the disk is full \(\d+ bytes free .* needs 1048576 bytes"):
        make(tmp_path, hub, fast_options).download(hub_files(REPO, ["m.gguf"], endpoint=hub.url))
    assert not list((tmp_path / "models").rglob("*.part.json.tmp"))
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before  # the part threads ended
    assert not (tmp_path / "models" / "m.gguf").exists()


def test_a_head_that_gets_a_5xx_is_retried_like_a_get(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    """A HEAD answered 503 (a busy hub, a CDN hiccup) failed the download at once; now it is retried with the
    GET's backoff, and the download goes on."""
    data = blob(64 * KIB, 11)
    hub.add(REPO, "m.gguf", data, head_errors=[503, 502])
    events: list[DownloadEvent] = []
    (path,) = make(tmp_path, hub, fast_options, events).download(
        hub_files(REPO, ["m.gguf"], endpoint=hub.url)
    )
    assert sha(path.read_bytes()) == sha(data)
    retries = [e.message for e in events if e.state == DownloadState.RETRYING]
    assert [m.split(";")[0] for m in retries[:2]] == [
        "cannot reach the server: the server answered HTTP 503",
        "cannot reach the server: the server answered HTTP 502",
    ]


def test_a_file_without_a_hash_in_its_headers_is_checked_against_the_hubs_api(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    """No X-Linked-Etag (not an LFS file, or a mirror that drops the header): the hub's paths-info API gives the
    sha256, and a flipped byte is still caught and fetched again."""
    data = blob(300 * KIB, 8)
    hub.add(REPO, "m.gguf", data, linked_etag=False, corrupt_offset=5000, corrupt_times=1)
    events: list[DownloadEvent] = []
    (path,) = make(tmp_path, hub, fast_options, events).download(
        hub_files(REPO, ["m.gguf"], endpoint=hub.url)
    )
    assert path.read_bytes() == data
    assert any(e.state == DownloadState.RETRYING and "sha256" in e.message for e in events)
    assert any(r.method == "POST" and "/paths-info/" in r.path for r in hub.requests)


def test_a_model_nobody_published_a_hash_for_is_checked_whole_and_the_user_told(
    tmp_path: Path, hub: Hub, fast_options: DownloadOptions
) -> None:
    from engine.testing.tiny_models import write_tiny_model

    good = write_tiny_model(tmp_path / "src.gguf", "qwen3moe", qtype="Q8_0", n_layer=2, seed=1).read_bytes()
    hub.add(REPO, "ok.gguf", good, linked_etag=False, api_sha=False)
    hub.add(
        REPO, "cut.gguf", good[: len(good) - 4096], linked_etag=False, api_sha=False
    )  # served whole, but short
    events: list[DownloadEvent] = []
    (path,) = make(tmp_path, hub, fast_options, events).download(
        hub_files(REPO, ["ok.gguf"], endpoint=hub.url)
    )
    assert path.read_bytes() == good
    done = [e for e in events if e.state == DownloadState.DONE]
    assert "no sha256 was published" in done[-1].message and "not every byte" in done[-1].message
    with pytest.raises(
        VerificationError, match=r"cut\.gguf (ends before its last tensor|is not a readable GGUF file)"
    ):
        make(tmp_path, hub, fast_options).download(hub_files(REPO, ["cut.gguf"], endpoint=hub.url))
    assert not (tmp_path / "models" / "cut.gguf").exists()
