"""Resumable, verified downloads of (multi-part) GGUF files from the Hugging Face hub or any HTTP server.

Each file is fetched in ranged parts over parallel connections into `<name>.part`; the byte offsets that are on disk
are kept in `<name>.part.json`, so a stall, a dropped connection, a crash or a restart resumes where it stopped.
A part that receives no byte for `stall_timeout_s` (30 s) is retried with exponential backoff. The file gets its
final name only after its size and sha256 (the hub's `X-Linked-Etag` for LFS files, or the catalog's) are checked:
nothing half-downloaded is ever at the final name. Free disk space is checked before the first byte.

Progress goes to a callback as typed `DownloadEvent`s (or through `iter_download`), always from the calling thread.
`HF_ENDPOINT` and a token (argument, `HF_TOKEN` or `HUGGING_FACE_HUB_TOKEN`) are honoured; the token is sent
only to the hub itself, never to the storage host it redirects to.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import queue
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urljoin, urlsplit

import requests

from installer.catalog import CatalogEntry

MIB = 1024**2
DEFAULT_ENDPOINT = "https://huggingface.co"
_SHA256_LEN = 64


class DownloadState(StrEnum):
    STARTING = "starting"
    DOWNLOADING = "downloading"
    STALLED = "stalled"
    RETRYING = "retrying"
    VERIFYING = "verifying"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class DownloadEvent:
    state: DownloadState
    file: str
    file_index: int
    file_count: int
    bytes_done: int
    bytes_total: int | None
    all_done: int
    all_total: int | None
    rate: float
    """Bytes per second over the last few seconds."""
    eta_s: float | None
    attempt: int = 0
    message: str = ""


def no_such_host(exc: BaseException) -> bool:
    """Whether a request failed because the server's name does not resolve (offline, or no DNS)."""
    text = repr(exc)
    return (
        "NameResolutionError" in text or "Name or service not known" in text or "getaddrinfo failed" in text
    )


def plain_reason(exc: BaseException) -> str:
    """A failed request's reason in words, not urllib3's text."""
    if no_such_host(exc):
        return "the server's name does not resolve (no network, or no DNS)"
    if isinstance(exc, requests.Timeout):
        return "the connection timed out"
    if isinstance(exc, requests.ConnectionError):
        return "the connection failed (refused, reset or no route)"
    return str(exc)


class DownloadError(Exception):
    """A download that cannot go on; the message says what happened and what to do."""


class DownloadCancelled(DownloadError):
    pass


class DiskFullError(DownloadError):
    pass


class VerificationError(DownloadError):
    pass


@dataclass(frozen=True)
class DownloadOptions:
    parts: int = 4
    """Parallel ranged connections per file."""
    min_part_bytes: int = 64 * MIB
    chunk_bytes: int = 1 * MIB
    stall_timeout_s: float = 30.0
    connect_timeout_s: float = 15.0
    max_retries: int = 6
    """Consecutive failures of one part without a byte of progress before the download fails."""
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    verify_retries: int = 1
    """Full re-downloads after a sha256 mismatch before giving up."""
    free_margin_bytes: int = 256 * MIB
    save_every_bytes: int = 8 * MIB
    """A part flushes its file and records its offset after this many bytes..."""
    save_interval_s: float = 1.0
    """...and the sidecar is rewritten at most this often (a crash re-fetches at most that much)."""
    event_interval_s: float = 0.25
    rate_window_s: float = 5.0


@dataclass(frozen=True)
class RemoteFile:
    url: str
    """Where to GET it (a hub `resolve` URL follows its redirect to the storage host on every request)."""
    name: str
    """File name under the destination folder."""
    size: int | None = None
    """Expected exact size, when known beforehand; otherwise taken from the server."""
    sha256: str | None = None
    """Expected sha256 (e.g. from the catalog); otherwise the hub's X-Linked-Etag, when it is one."""
    label: str = ""
    """Shown in events (the repo path); defaults to the name."""


def hf_endpoint(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hf_token(token: str | None = None) -> str | None:
    return token or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def hf_resolve_url(repo: str, path: str, revision: str = "main", endpoint: str | None = None) -> str:
    return f"{hf_endpoint(endpoint)}/{repo}/resolve/{quote(revision, safe='')}/{quote(path)}"


def entry_files(entry: CatalogEntry, revision: str = "main", endpoint: str | None = None) -> list[RemoteFile]:
    exact = entry.size_exact
    return [
        RemoteFile(
            url=hf_resolve_url(entry.hf_repo, f.path, revision, endpoint),
            name=f.name,
            size=f.size_bytes if exact else None,
            sha256=f.sha256,
            label=f.path,
        )
        for f in entry.files
    ]


def hub_files(
    repo: str, paths: Sequence[str], revision: str = "main", endpoint: str | None = None
) -> list[RemoteFile]:
    return [
        RemoteFile(hf_resolve_url(repo, p, revision, endpoint), p.rsplit("/", 1)[-1], label=p) for p in paths
    ]


# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Part:
    start: int
    end: int
    """Exclusive."""
    pos: int
    """Next byte to write (progress shown)."""
    saved: int
    """Bytes from start that are flushed to the .part file (what the sidecar records)."""
    attempt_start: int = 0
    """`pos` when the current connection started: tells a retry after progress from one without."""

    @property
    def complete(self) -> bool:
        return self.saved >= self.end


@dataclass
class _Meta:
    size: int
    sha256: str | None
    etag: str | None


@dataclass
class _Run:
    """State shared between the coordinator (calling thread) and the part workers of one file."""

    remote: RemoteFile
    meta: _Meta
    part_path: Path
    state_path: Path
    parts: list[_Part]
    lock: threading.Lock = field(default_factory=threading.Lock)
    events: queue.Queue[tuple[DownloadState, str, int]] = field(default_factory=queue.Queue)
    error: DownloadError | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    no_ranges: bool = False
    """The server ignores Range: one connection from byte 0, and from byte 0 again after a cut."""
    one_connection: bool = False

    def done_bytes(self) -> int:
        with self.lock:
            return sum(p.pos - p.start for p in self.parts)


class _Retryable(Exception):
    pass


class _NoRanges(Exception):
    """The server answered a ranged request with the whole file: the download goes on over one connection."""


UNVERIFIED = "no sha256 was published for it: its size and GGUF structure were checked, not every byte"


def gguf_problem(path: Path, name: str) -> str | None:
    """None when `path` is a whole GGUF file (header readable, every tensor's data inside the file); otherwise
    what is wrong. The check for a download whose sha256 nobody published."""
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except (OSError, ValueError, KeyError, IndexError) as e:
        return f"{name} is not a readable GGUF file ({str(e)[:120]})"
    if end > path.stat().st_size:
        return f"{name} ends before its last tensor (byte {end} of {path.stat().st_size})"
    return None


def _write_chunk(fh: Any, data: bytes) -> None:
    """The one place bytes reach the disk (a seam for the disk-full tests)."""
    fh.write(data)


def _auth_for(url: str, endpoint: str, token: str | None) -> dict[str, str]:
    """The token goes only to the hub's own host, never to a storage host it redirects to."""
    if token and urlsplit(url).netloc == urlsplit(endpoint).netloc:
        return {"Authorization": f"Bearer {token}"}
    return {}


class _HubSession(requests.Session):
    hub_netloc: str = ""

    def rebuild_auth(self, prepared_request: Any, response: Any) -> None:
        # requests keeps Authorization when a redirect stays on the same host; drop it anywhere but the hub.
        super().rebuild_auth(prepared_request, response)
        if urlsplit(prepared_request.url).netloc != self.hub_netloc:
            prepared_request.headers.pop("Authorization", None)


def _http_error(status: int, remote: RemoteFile, url: str) -> DownloadError:
    what = remote.label or remote.name
    if status in (401, 403):
        return DownloadError(
            f"the server refused {what} (HTTP {status}) at {url}: the model may be gated or private - accept its "
            "license on huggingface.co and set HF_TOKEN (or pass a token), then try again"
        )
    if status == 404:
        return DownloadError(f"{what} was not found (HTTP 404) at {url}: check the repo and file name")
    if status == 416:
        return DownloadError(
            f"the server rejected the byte range of {what} (HTTP 416): the file changed; start over"
        )
    return DownloadError(f"the server answered HTTP {status} for {what} at {url}")


class Downloader:
    """Downloads files into `dest_dir`. One instance can be reused; `cancel()` may be called from any thread."""

    def __init__(
        self,
        dest_dir: str | os.PathLike[str],
        *,
        token: str | None = None,
        endpoint: str | None = None,
        options: DownloadOptions | None = None,
        on_event: Callable[[DownloadEvent], None] | None = None,
        disk_usage: Callable[[str], Any] = shutil.disk_usage,
    ) -> None:
        self.dest_dir = Path(dest_dir)
        self.endpoint = hf_endpoint(endpoint)
        self.token = hf_token(token)
        self.options = options or DownloadOptions()
        self.on_event = on_event
        self.disk_usage = disk_usage
        self._cancel = threading.Event()
        self._samples: deque[tuple[float, int]] = deque()
        self._file_index = 0
        self._file_count = 0
        self._before = 0
        self._all_total: int | None = None
        self._reported = False

    # -- public -----------------------------------------------------------------------------------------------

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def download_entry(self, entry: CatalogEntry, revision: str = "main") -> list[Path]:
        return self.download(entry_files(entry, revision, self.endpoint))

    def download(self, files: Sequence[RemoteFile]) -> list[Path]:
        """Fetch every file (resuming what is on disk), verify each, and return their final paths."""
        self._cancel.clear()
        self._file_count = len(files)
        self._reported = False
        self.dest_dir.mkdir(parents=True, exist_ok=True)
        session = self._session()
        try:
            metas = []
            for i, remote in enumerate(files):
                self._file_index = i
                self._emit(
                    DownloadState.STARTING,
                    remote,
                    0,
                    remote.size,
                    message="asking the server for the file size",
                )
                metas.append(self._resolve(session, remote))
            self._all_total = sum(m.size for m in metas)
            self._check_disk(files, metas)
            out = []
            self._before = 0
            for i, (remote, meta) in enumerate(zip(files, metas, strict=True)):
                self._file_index = i
                out.append(self._download_file(remote, meta))
                self._before += meta.size
            return out
        except DownloadError as exc:
            if not self._reported and files:
                state = (
                    DownloadState.CANCELLED if isinstance(exc, DownloadCancelled) else DownloadState.FAILED
                )
                remote = files[min(self._file_index, len(files) - 1)]
                self._emit(state, remote, 0, remote.size, message=str(exc))
            raise
        finally:
            session.close()

    # -- steps ------------------------------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session = _HubSession()
        session.hub_netloc = urlsplit(self.endpoint).netloc
        session.headers["User-Agent"] = "polystrata-installer"
        return session

    def _final(self, remote: RemoteFile) -> Path:
        return self.dest_dir / remote.name

    def _resolve(self, session: requests.Session, remote: RemoteFile) -> _Meta:
        """Size and sha256 from the server, following redirects by hand to read the hub's X-Linked-* headers."""
        attempt = 0
        while True:
            if self._cancel.is_set():
                raise DownloadCancelled(f"download of {remote.label or remote.name} cancelled")
            try:
                return self._head(session, remote)
            except requests.RequestException as exc:
                attempt += 1
                host = urlsplit(remote.url).netloc
                offline = no_such_host(
                    exc
                )  # no name service: waiting ~100 s for retries would change nothing
                if offline or attempt > self.options.max_retries:
                    tries = "" if offline else f" after {self.options.max_retries} retries"
                    mirror = (
                        f" (or the mirror in HF_ENDPOINT, {host})"
                        if host != urlsplit(DEFAULT_ENDPOINT).netloc
                        else ""
                    )
                    raise DownloadError(
                        f"cannot reach {host} for {remote.label or remote.name}{tries}: {plain_reason(exc)}. "
                        f"Check this PC's network connection{mirror}, then try again; what is on disk is kept"
                    ) from exc
                self._backoff(remote, attempt, f"cannot reach the server: {plain_reason(exc)}")

    def _head(self, session: requests.Session, remote: RemoteFile) -> _Meta:
        url = remote.url
        linked_size: str | None = None
        linked_etag: str | None = None
        timeout = (self.options.connect_timeout_s, self.options.stall_timeout_s)
        for _ in range(8):
            r = session.head(
                url, allow_redirects=False, headers=_auth_for(url, self.endpoint, self.token), timeout=timeout
            )
            linked_size = linked_size or r.headers.get("X-Linked-Size")
            linked_etag = linked_etag or r.headers.get("X-Linked-Etag")
            if r.status_code in (301, 302, 303, 307, 308) and "Location" in r.headers:
                url = urljoin(url, r.headers["Location"])
                continue
            if r.status_code >= 500 or r.status_code == 429:  # the server's trouble: retried, as a GET's is
                raise requests.HTTPError(f"the server answered HTTP {r.status_code}")
            if r.status_code >= 400:
                raise _http_error(r.status_code, remote, url)
            break
        else:
            raise DownloadError(f"too many redirects for {remote.label or remote.name} at {remote.url}")
        size_text = linked_size or r.headers.get("Content-Length")
        if not size_text or not size_text.isdigit():
            raise DownloadError(
                f"the server did not say how big {remote.label or remote.name} is ({remote.url})"
            )
        size = int(size_text)
        if remote.size is not None and remote.size != size:
            raise DownloadError(
                f"{remote.label or remote.name} is {size} bytes on the server but {remote.size} in the catalog: "
                "the file changed upstream; update PolyStrata or choose another model"
            )
        etag = (linked_etag or r.headers.get("ETag") or "").strip().removeprefix("W/").strip('"') or None
        hub_sha = (
            etag.lower()
            if etag and len(etag) == _SHA256_LEN and all(c in "0123456789abcdefABCDEF" for c in etag)
            else None
        )
        expected = remote.sha256.lower() if remote.sha256 else hub_sha
        if expected is None:
            # no hash in the headers (not an LFS file, or a mirror): the hub's API may know it
            expected = self._api_sha256(session, remote)
        if remote.sha256 and hub_sha and remote.sha256.lower() != hub_sha:
            raise DownloadError(
                f"{remote.label or remote.name}: the catalog's sha256 differs from the hub's ({hub_sha}); the file "
                "changed upstream - update PolyStrata or choose another model"
            )
        return _Meta(size=size, sha256=expected, etag=etag)

    def _api_sha256(self, session: requests.Session, remote: RemoteFile) -> str | None:
        """The file's sha256 from the hub's paths-info API (its LFS object id), for a hub `resolve` URL; None when
        the hub does not know one or does not answer (the file is then checked another way: _verify)."""
        m = re.fullmatch(r"(.*)/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", remote.url)
        if m is None:
            return None
        base, repo, rev, path = m.groups()
        api = f"{base}/api/models/{repo}/paths-info/{rev}"
        timeout = (self.options.connect_timeout_s, self.options.stall_timeout_s)
        try:
            r = session.post(api, data={"paths": unquote(path)}, headers=_auth_for(api, self.endpoint, self.token),
                             timeout=timeout)  # fmt: skip
            rows = r.json() if r.status_code == 200 else []
        except (requests.RequestException, ValueError):
            return None
        for row in rows if isinstance(rows, list) else []:
            lfs = row.get("lfs") if isinstance(row, dict) else None
            oid = str(lfs.get("oid") or "") if isinstance(lfs, dict) else ""
            if (
                row.get("path") == unquote(path)
                and len(oid) == _SHA256_LEN
                and re.fullmatch(r"[0-9a-f]+", oid)
            ):
                return oid
        return None

    def _check_disk(self, files: Sequence[RemoteFile], metas: Sequence[_Meta]) -> None:
        need = 0
        for remote, meta in zip(files, metas, strict=True):
            final = self._final(remote)
            if final.is_file() and final.stat().st_size == meta.size:
                continue
            have = 0
            state = self._load_state(final.with_name(final.name + ".part.json"), meta)
            if state is not None:
                have = sum(p.saved - p.start for p in state)
            need += meta.size - have
        free = int(self.disk_usage(str(self.dest_dir)).free)
        if need + self.options.free_margin_bytes > free:
            raise DiskFullError(
                f"not enough free disk space in {self.dest_dir}: the download needs {need / 1e9:.1f} GB more and "
                f"{free / 1e9:.1f} GB are free; free up space or choose another folder (--models-dir)"
            )

    def _download_file(self, remote: RemoteFile, meta: _Meta) -> Path:
        final = self._final(remote)
        if final.is_file() and final.stat().st_size == meta.size:
            # Only verified files ever get the final name, so one with the right size is complete.
            self._emit(DownloadState.DONE, remote, meta.size, meta.size, message="already downloaded")
            return final
        for attempt in range(self.options.verify_retries + 1):
            run = self._prepare(remote, meta)
            self._fetch(run)
            problem = self._verify(run)
            if problem is None:
                run.state_path.unlink(missing_ok=True)
                os.replace(run.part_path, final)
                how = "" if meta.sha256 else f" ({UNVERIFIED})"
                self._emit(DownloadState.DONE, remote, meta.size, meta.size, message=f"saved as {final}{how}")
                return final
            run.part_path.unlink(missing_ok=True)
            run.state_path.unlink(missing_ok=True)
            if attempt < self.options.verify_retries:
                self._emit(
                    DownloadState.RETRYING,
                    remote,
                    0,
                    meta.size,
                    attempt + 1,
                    f"{problem}; downloading it again",
                )
                continue
            message = f"{problem}; the download was corrupted {attempt + 1} times - check the network and disk, then try again"
            self._emit(DownloadState.FAILED, remote, 0, meta.size, message=message)
            self._reported = True
            raise VerificationError(message)
        raise AssertionError("unreachable")

    # -- parts ------------------------------------------------------------------------------------------------

    def _plan(self, size: int) -> list[_Part]:
        n = max(1, min(self.options.parts, size // max(self.options.min_part_bytes, 1)))
        bounds = [size * i // n for i in range(n + 1)]
        return [_Part(bounds[i], bounds[i + 1], bounds[i], bounds[i]) for i in range(n)]

    def _load_state(self, state_path: Path, meta: _Meta) -> list[_Part] | None:
        part_path = state_path.with_suffix("")  # <name>.part
        if not state_path.is_file() or not part_path.is_file():
            return None
        try:
            data = json.loads(state_path.read_text(encoding="utf-8"))
            if (
                data.get("size") != meta.size
                or data.get("sha256") != meta.sha256
                or data.get("etag") != meta.etag
            ):
                return None
            parts = [_Part(p["start"], p["end"], p["saved"], p["saved"]) for p in data["parts"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        ok = parts and parts[0].start == 0 and parts[-1].end == meta.size
        ok = ok and all(a.end == b.start for a, b in itertools.pairwise(parts))
        ok = ok and all(p.start <= p.saved <= p.end for p in parts) and part_path.stat().st_size == meta.size
        return parts if ok else None

    def _save_state(self, run: _Run) -> None:
        with run.lock:
            parts = [{"start": p.start, "end": p.end, "saved": p.saved} for p in run.parts]
        data = {
            "url": run.remote.url,
            "size": run.meta.size,
            "sha256": run.meta.sha256,
            "etag": run.meta.etag,
            "parts": parts,
        }
        tmp = run.state_path.with_name(run.state_path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(data), encoding="utf-8")
            os.replace(tmp, run.state_path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                free = shutil.disk_usage(run.state_path.parent).free
                raise DiskFullError(
                    f"the disk is full ({free} bytes free in {self.dest_dir}; {run.remote.name} needs "
                    f"{run.meta.size} bytes in all): free up space there, then start the download again (it "
                    "resumes where it stopped)"
                ) from None
            raise DownloadError(f"cannot write {run.state_path}: {exc.strerror or exc}") from None

    def _keep_state(self, run: _Run) -> None:
        """_save_state while the parts download: a failure stops them (the run's error), it does not escape."""
        try:
            self._save_state(run)
        except DownloadError as exc:
            self._fail(run, exc)

    def _prepare(self, remote: RemoteFile, meta: _Meta) -> _Run:
        final = self._final(remote)
        part_path = final.with_name(final.name + ".part")
        state_path = final.with_name(final.name + ".part.json")
        parts = self._load_state(state_path, meta)
        if parts is None:
            # No trustworthy record of what is on disk: start this file over.
            state_path.unlink(missing_ok=True)
            with part_path.open("wb") as fh:
                fh.truncate(meta.size)
            parts = self._plan(meta.size)
        run = _Run(remote, meta, part_path, state_path, parts)
        self._save_state(run)
        return run

    def _fetch(self, run: _Run) -> None:
        todo = [p for p in run.parts if not p.complete]
        threads = [threading.Thread(target=self._part_worker, args=(run, p), daemon=True) for p in todo]
        for t in threads:
            t.start()
        last_save = time.monotonic()
        last_event = 0.0
        state = DownloadState.DOWNLOADING
        trouble_at: int | None = None  # bytes done when a part stalled or failed
        while any(t.is_alive() for t in threads):
            if self._cancel.is_set():
                run.stop.set()
            try:
                st, msg, attempt = run.events.get(timeout=self.options.event_interval_s)
                state, trouble_at = st, run.done_bytes()
                self._emit(st, run.remote, trouble_at, run.meta.size, attempt, msg)
            except queue.Empty:
                pass
            now = time.monotonic()
            if now - last_save >= self.options.save_interval_s:
                self._keep_state(run)
                last_save = now
            if now - last_event >= self.options.event_interval_s:
                done = run.done_bytes()
                if trouble_at is not None and done > trouble_at:
                    state, trouble_at = DownloadState.DOWNLOADING, None
                self._emit(state, run.remote, done, run.meta.size)
                last_event = now
        for t in threads:
            t.join()
        if run.no_ranges and not run.one_connection and run.error is None and not self._cancel.is_set():
            run.one_connection = True
            run.parts = [_Part(0, run.meta.size, 0, 0)]
            run.stop.clear()
            self._emit(DownloadState.RETRYING, run.remote, 0, run.meta.size, 1,
                       "the server does not take ranged requests: downloading over one connection from the start")  # fmt: skip
            self._fetch(run)
            return
        while not run.events.empty():
            st, msg, attempt = run.events.get_nowait()
            self._emit(st, run.remote, run.done_bytes(), run.meta.size, attempt, msg)
        self._keep_state(run)
        if run.error is not None:
            self._emit(
                DownloadState.FAILED, run.remote, run.done_bytes(), run.meta.size, message=str(run.error)
            )
            self._reported = True
            raise run.error
        if self._cancel.is_set():
            msg = (
                f"download of {run.remote.label or run.remote.name} cancelled; it resumes from here next time"
            )
            self._emit(DownloadState.CANCELLED, run.remote, run.done_bytes(), run.meta.size, message=msg)
            self._reported = True
            raise DownloadCancelled(msg)
        if not all(p.complete for p in run.parts):  # never verify, let alone rename, a file with holes
            error = DownloadError(
                f"the download of {run.remote.name} ended with missing bytes; start it again"
            )
            self._emit(DownloadState.FAILED, run.remote, run.done_bytes(), run.meta.size, message=str(error))
            self._reported = True
            raise error

    def _fail(self, run: _Run, error: DownloadError) -> None:
        with run.lock:
            if run.error is None:
                run.error = error
        run.stop.set()

    def _part_worker(self, run: _Run, part: _Part) -> None:
        session = self._session()  # one connection pool per thread
        attempts = 0
        try:
            while not part.complete and not run.stop.is_set():
                try:
                    self._fetch_range(session, run, part)
                    continue
                except DownloadError as exc:
                    self._fail(run, exc)
                    return
                except _NoRanges:
                    run.no_ranges = True
                    run.stop.set()  # every part stops; _fetch goes on over one connection
                    return
                # Before OSError: requests' exceptions are OSErrors too.
                except (requests.RequestException, _Retryable) as exc:
                    failure: BaseException = exc
                    stalled = isinstance(exc, requests.Timeout) or "timed out" in str(exc).lower()
                except OSError as exc:
                    if exc.errno == errno.ENOSPC:
                        msg = (
                            f"the disk is full while writing {run.part_path}: free up space in {self.dest_dir}, "
                            "then start the download again (it resumes where it stopped)"
                        )
                        self._fail(run, DiskFullError(msg))
                    else:
                        self._fail(run, DownloadError(f"cannot write {run.part_path}: {exc.strerror or exc}"))
                    return
                except Exception as exc:  # a bug or an odd server: stop this file, keep what is on disk
                    self._fail(run, DownloadError(f"the download of {run.remote.name} stopped: {exc!r}"))
                    return
                with run.lock:
                    progressed = part.pos > part.attempt_start
                attempts = 1 if progressed else attempts + 1
                if stalled:
                    secs = self.options.stall_timeout_s
                    run.events.put(
                        (
                            DownloadState.STALLED,
                            f"no data for {secs:g} s (bytes {part.pos}-{part.end - 1})",
                            0,
                        )
                    )
                if not self._wait_retry(run, attempts, failure, stalled):
                    return
        finally:
            session.close()

    def _wait_retry(self, run: _Run, attempts: int, exc: BaseException, stalled: bool) -> bool:
        opts = self.options
        if attempts > opts.max_retries:
            what = "stalled" if stalled else "failed"
            self._fail(
                run,
                DownloadError(
                    f"the download of {run.remote.label or run.remote.name} {what} {opts.max_retries} times in a row "
                    f"({exc}); check the network and start it again - it resumes where it stopped"
                ),
            )
            return False
        delay = min(opts.backoff_base_s * 2 ** (attempts - 1), opts.backoff_max_s)
        reason = "stalled" if stalled else f"connection problem: {exc}"
        run.events.put(
            (
                DownloadState.RETRYING,
                f"{reason}; retry {attempts} of {opts.max_retries} in {delay:.1f} s",
                attempts,
            )
        )
        return not run.stop.wait(delay)

    def _fetch_range(self, session: requests.Session, run: _Run, part: _Part) -> None:
        opts = self.options
        start, end = part.pos, part.end
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        headers.update(_auth_for(run.remote.url, self.endpoint, self.token))
        with run.lock:
            part.attempt_start = part.pos
        with session.get(
            run.remote.url,
            headers=headers,
            stream=True,
            timeout=(opts.connect_timeout_s, opts.stall_timeout_s),
        ) as r:
            if r.status_code == 200 and not (start == 0 and end == run.meta.size):
                if not run.no_ranges:
                    raise _NoRanges()
                start = 0  # one connection after a cut: the server starts from byte 0 again, so do we
                with run.lock:
                    part.pos = part.saved = part.attempt_start = 0
            if r.status_code in (429,) or r.status_code >= 500:
                raise _Retryable(f"HTTP {r.status_code}")
            if r.status_code not in (200, 206):
                raise _http_error(r.status_code, run.remote, run.remote.url)
            if r.status_code == 206:
                content_range = r.headers.get("Content-Range", "")
                if not content_range.startswith(f"bytes {start}-"):
                    raise _Retryable(
                        f"unexpected Content-Range {content_range!r} for bytes {start}-{end - 1}"
                    )
            with run.part_path.open("r+b") as fh:
                fh.seek(start)
                pos = start
                unsaved = 0
                for chunk in r.iter_content(opts.chunk_bytes):
                    if run.stop.is_set():
                        break
                    if not chunk:
                        continue
                    chunk = chunk[: end - pos]
                    _write_chunk(fh, chunk)
                    pos += len(chunk)
                    unsaved += len(chunk)
                    with run.lock:
                        part.pos = pos
                    if unsaved >= opts.save_every_bytes:
                        fh.flush()
                        with run.lock:
                            part.saved = pos
                        unsaved = 0
                    if pos >= end:
                        break
                fh.flush()
                with run.lock:
                    part.saved = pos
        if pos < end and not run.stop.is_set():
            raise _Retryable(f"the connection closed after {pos - start} of {end - start} bytes")

    def _verify(self, run: _Run) -> str | None:
        """None when size and sha256 match; otherwise what is wrong."""
        size = run.part_path.stat().st_size
        name = run.remote.label or run.remote.name
        if size != run.meta.size:
            return f"{name} has {size} bytes on disk, expected {run.meta.size}"
        if run.meta.sha256 is None:  # nothing published to compare with: a model file must at least be whole
            return gguf_problem(run.part_path, name) if run.remote.name.lower().endswith(".gguf") else None
        digest = hashlib.sha256()
        done = 0
        last = 0.0
        with run.part_path.open("rb") as fh:
            while block := fh.read(8 * MIB):
                if self._cancel.is_set():
                    msg = f"check of {name} cancelled; it is checked again next time"
                    self._emit(DownloadState.CANCELLED, run.remote, done, run.meta.size, message=msg)
                    raise DownloadCancelled(msg)
                digest.update(block)
                done += len(block)
                now = time.monotonic()
                if now - last >= self.options.event_interval_s:
                    self._emit(
                        DownloadState.VERIFYING, run.remote, done, run.meta.size, message="checking sha256"
                    )
                    last = now
        got = digest.hexdigest()
        self._emit(DownloadState.VERIFYING, run.remote, done, run.meta.size, message="checking sha256")
        if got != run.meta.sha256:
            return f"the sha256 of {name} is {got}, expected {run.meta.sha256}"
        return None

    # -- events -----------------------------------------------------------------------------------------------

    def _backoff(self, remote: RemoteFile, attempt: int, reason: str) -> None:
        delay = min(self.options.backoff_base_s * 2 ** (attempt - 1), self.options.backoff_max_s)
        self._emit(
            DownloadState.RETRYING, remote, 0, remote.size, attempt, f"{reason}; retry in {delay:.1f} s"
        )
        self._cancel.wait(delay)

    def _emit(
        self,
        state: DownloadState,
        remote: RemoteFile,
        done: int,
        total: int | None,
        attempt: int = 0,
        message: str = "",
    ) -> None:
        now = time.monotonic()
        all_done = self._before + done
        if state in (DownloadState.DOWNLOADING, DownloadState.STALLED, DownloadState.RETRYING):
            self._samples.append((now, all_done))
            while self._samples and now - self._samples[0][0] > self.options.rate_window_s:
                self._samples.popleft()
        rate = 0.0
        if len(self._samples) >= 2:
            (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
            rate = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
        eta = (self._all_total - all_done) / rate if rate > 0 and self._all_total is not None else None
        if self.on_event is None:
            return
        self.on_event(
            DownloadEvent(
                state=state,
                file=remote.label or remote.name,
                file_index=self._file_index,
                file_count=self._file_count,
                bytes_done=done,
                bytes_total=total,
                all_done=all_done,
                all_total=self._all_total,
                rate=max(rate, 0.0),
                eta_s=eta,
                attempt=attempt,
                message=message,
            )
        )


def iter_download(downloader: Downloader, files: Sequence[RemoteFile]) -> Iterator[DownloadEvent]:
    """The download's events as an iterator (the download runs in a thread); its error is raised at the end."""
    events: queue.Queue[DownloadEvent | None] = queue.Queue()
    result: dict[str, BaseException] = {}
    previous = downloader.on_event

    def run() -> None:
        try:
            downloader.download(files)
        except BaseException as exc:
            result["error"] = exc
        finally:
            events.put(None)

    downloader.on_event = events.put
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        while (event := events.get()) is not None:
            yield event
    finally:
        downloader.on_event = previous
        if worker.is_alive():
            downloader.cancel()
            worker.join()
    if "error" in result:
        raise result["error"]
