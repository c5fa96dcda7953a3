"""A local imitation of the Hugging Face hub's file endpoints, for download tests on 127.0.0.1.

Two real HTTP servers: the hub answers `/{owner}/{repo}/resolve/{rev}/{path}` with a 302 to the storage server and
the headers the hub sends for LFS files (X-Linked-Size, X-Linked-Etag = sha256); the storage server serves bytes with
HTTP ranges. Misbehaviour is scripted per file: drop the connection after N body bytes, stall after N bytes, flip a
byte the first K times it is served, ignore ranges, or throttle.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote


@dataclass
class HostedFile:
    data: bytes
    drops: list[int] = field(default_factory=list)
    """Each GET takes the next number: send that many body bytes, then drop the connection."""
    stalls: list[int] = field(default_factory=list)
    """Each GET takes the next number: send that many body bytes, then go silent."""
    corrupt_offset: int | None = None
    corrupt_times: int = 0
    """Serve the byte at corrupt_offset flipped this many times."""
    ranges: bool = True
    throttle_s: float = 0.0
    """Sleep this long after each 16 KiB written."""
    head_errors: list[int] = field(default_factory=list)
    """Each HEAD of the resolve URL takes the next status (a 5xx, say) and answers only that."""
    linked_etag: bool = True
    """Send X-Linked-Etag (the sha256 of an LFS file); False: a file whose headers carry no hash."""
    api_sha: bool = True
    """The paths-info API reports the file's LFS object id (its sha256); False: it reports none."""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass
class Request:
    server: str
    method: str
    path: str
    range: str | None
    authorization: str | None


class Hub:
    def __init__(self, token: str | None = None) -> None:
        self.files: dict[str, HostedFile] = {}
        self.token = token
        self.requests: list[Request] = []
        self.served_bytes = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self._hub = self._server("hub")
        self._storage = self._server("storage")

    # -- setup ---------------------------------------------------------------------------------------------------

    def add(self, repo: str, path: str, data: bytes, **behaviour: object) -> HostedFile:
        hosted = HostedFile(data, **behaviour)  # type: ignore[arg-type]
        self.files[f"{repo}/{path}"] = hosted
        return hosted

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._hub.server_address[1]}"

    @property
    def storage_url(self) -> str:
        return f"http://127.0.0.1:{self._storage.server_address[1]}"

    def reset_counters(self) -> None:
        with self.lock:
            self.served_bytes = 0
            self.requests.clear()

    def close(self) -> None:
        self.stop.set()
        for srv in (self._hub, self._storage):
            srv.shutdown()
            srv.server_close()

    # -- servers -------------------------------------------------------------------------------------------------

    def _server(self, role: str) -> ThreadingHTTPServer:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._handle(head=True)

            def do_GET(self) -> None:
                self._handle(head=False)

            def do_POST(
                self,
            ) -> None:  # the hub's paths-info API: each path's size and LFS object id (sha256)
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/paths-info/([^/]+)", unquote(self.path))
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
                with hub.lock:
                    hub.requests.append(
                        Request(role, "POST", self.path, None, self.headers.get("Authorization"))
                    )
                if role != "hub" or not m:
                    return self._empty(404)
                rows = []
                for path in parse_qs(body).get("paths", []):
                    hosted = hub.files.get(f"{m.group(1)}/{path}")
                    if hosted is not None:
                        row: dict[str, object] = {"type": "file", "path": path, "size": len(hosted.data)}
                        if hosted.api_sha:
                            row["lfs"] = {"oid": hosted.sha256, "size": len(hosted.data)}
                        rows.append(row)
                data = json.dumps(rows).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, head: bool) -> None:
                with hub.lock:
                    hub.requests.append(
                        Request(
                            role,
                            self.command,
                            self.path,
                            self.headers.get("Range"),
                            self.headers.get("Authorization"),
                        )
                    )
                if role == "hub":
                    self._resolve()
                else:
                    self._serve(head)

            def _empty(self, status: int, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _resolve(self) -> None:
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", unquote(self.path))
                if not m:
                    return self._empty(404)
                if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._empty(401)
                key = f"{m.group(1)}/{m.group(3)}"
                hosted = hub.files.get(key)
                if hosted is None:
                    return self._empty(404)
                if self.command == "HEAD" and hosted.head_errors:
                    return self._empty(hosted.head_errors.pop(0))
                self._empty(
                    302,
                    {
                        "Location": f"{hub.storage_url}/cdn/{key}",
                        "X-Linked-Size": str(len(hosted.data)),
                        **({"X-Linked-Etag": f'"{hosted.sha256}"'} if hosted.linked_etag else {}),
                        "ETag": '"0123456789abcdef0123456789abcdef01234567"',
                    },
                )

            def _serve(self, head: bool) -> None:
                key = unquote(self.path).removeprefix("/cdn/")
                hosted = hub.files.get(key)
                if hosted is None:
                    return self._empty(404)
                size = len(hosted.data)
                start, end = 0, size  # end exclusive
                rng = self.headers.get("Range")
                status = 200
                if rng and hosted.ranges:
                    m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng)
                    if not m or int(m.group(1)) >= size:
                        return self._empty(416, {"Content-Range": f"bytes */{size}"})
                    start = int(m.group(1))
                    end = min(int(m.group(2)) + 1, size) if m.group(2) else size
                    status = 206
                body = bytearray(hosted.data[start:end])
                with hub.lock:
                    flip = hosted.corrupt_offset is not None and hosted.corrupt_times > 0 and not head
                    if flip and start <= hosted.corrupt_offset < end:  # type: ignore[operator]
                        body[hosted.corrupt_offset - start] ^= 0xFF  # type: ignore[operator]
                        hosted.corrupt_times -= 1
                    drop = hosted.drops.pop(0) if hosted.drops and not head else None
                    stall = hosted.stalls.pop(0) if hosted.stalls and not head else None
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes" if hosted.ranges else "none")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
                self.end_headers()
                if head:
                    return None
                limit = len(body)
                for cut in (drop, stall):
                    if cut is not None:
                        limit = min(limit, cut)
                try:
                    sent = 0
                    while sent < limit:
                        piece = bytes(body[sent : min(sent + 16384, limit)])
                        self.wfile.write(piece)
                        sent += len(piece)
                        with hub.lock:
                            hub.served_bytes += len(piece)
                        if hosted.throttle_s:
                            time.sleep(hosted.throttle_s)
                    self.wfile.flush()
                    if stall is not None and stall < len(body):
                        hub.stop.wait(5.0)
                    if limit < len(body):
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    self.close_connection = True
                return None

        srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return srv
