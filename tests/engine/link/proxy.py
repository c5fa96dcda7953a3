"""A TCP relay whose link can be cut: while cut it neither reads nor writes (packets vanish, no FIN, no RST), as
when a cable is pulled or a switch drops the route; mended, it carries on. It can also delay what it forwards
(a slow, jittery link where the kernel has no netem)."""

import random
import socket
import threading
import time


class CuttableLink:
    def __init__(self, target_port: int, delay_s: float = 0.0, jitter_s: float = 0.0) -> None:
        self.target = target_port
        self.delay_s, self.jitter_s = delay_s, jitter_s  # per forwarded chunk, each direction (order kept)
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.cut = threading.Event()
        self.closed = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                c.close()
                continue
            with self._lock:
                self._socks += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        a.settimeout(0.05)
        try:
            while not self.closed.is_set():
                if self.cut.is_set():
                    self.closed.wait(0.05)
                    continue
                try:
                    data = a.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                while self.cut.is_set() and not self.closed.is_set():
                    self.closed.wait(
                        0.05
                    )  # cut while this chunk was in the air: it waits, as in a router's queue
                if self.delay_s:
                    time.sleep(max(0.0, self.delay_s + random.uniform(-self.jitter_s, self.jitter_s)))
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.closed.set()
        self.lsock.close()
        with self._lock:
            for s in self._socks:
                try:
                    s.close()
                except OSError:
                    pass
