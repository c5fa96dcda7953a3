"""mDNS (zeroconf) advertisement and browsing of node agents: a hint only.

An advert says where an agent might be (addresses, ports), its key fingerprint, version and GPUs. Anyone on the LAN
can send one, so nothing here is trusted: the main PC asks the address for its identity, the user compares the
fingerprint with the one the agent prints, and from then on the pinned key decides (a CURVE handshake with another
key fails). A found agent whose advertised fingerprint differs from the one it answers with is marked.
"""

import ipaddress
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil
from zeroconf import InterfaceChoice, IPVersion, ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf

from engine.node.wire import SERVICE_TYPE
from installer.version import __version__


def _interfaces_for(host: str) -> Any:
    if host in ("0.0.0.0", "::", ""):
        return InterfaceChoice.All
    return [host]


def _addresses_for(host: str) -> list[str]:
    if host not in ("0.0.0.0", "::", ""):
        return [host]

    out = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                out.append(a.address)
    return out or ["127.0.0.1"]


def _label(name: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9-]+", "-", name).strip("-")[:40]
    return clean or "worker"


class Advert:
    """Registers `<name>-<fp>._strata-node._tcp.local.` while the agent runs."""

    def __init__(self, name: str, host: str, port: int, id_port: int, fingerprint: str, gpus: str) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.id_port = id_port
        self.fingerprint = fingerprint
        self.gpus = gpus
        self.zc: Any = None
        self.info: Any = None
        self._thread: threading.Thread | None = None
        self.error: str = ""

    def start(self) -> None:
        """Register in the background: zeroconf's probing takes about two seconds the agent need not wait for."""
        self._thread = threading.Thread(target=self._register, name="mdns-advert", daemon=True)
        self._thread.start()

    def _register(self) -> None:
        try:
            self.register()
        except Exception as exc:  # a hint only: the agent serves without it
            self.error = str(exc)

    def register(self) -> None:
        addrs = _addresses_for(self.host)
        v6 = any(":" in a for a in addrs)
        label = f"{_label(self.name)}-{self.fingerprint[:4]}"
        self.info = ServiceInfo(
            SERVICE_TYPE,
            f"{label}.{SERVICE_TYPE}",
            parsed_addresses=addrs,
            port=self.port,
            properties={
                "name": self.name[:60],
                "fp": self.fingerprint,
                "v": __version__,
                "idp": str(self.id_port),
                "gpus": self.gpus[:180],
            },
            server=f"{label}.local.",
        )
        self.zc = Zeroconf(
            interfaces=_interfaces_for(self.host), ip_version=IPVersion.All if v6 else IPVersion.V4Only
        )
        self.zc.register_service(self.info, allow_name_change=True)

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.join(5)
        if self.zc is not None:
            try:
                self.zc.unregister_service(self.info)
            finally:
                self.zc.close()
            self.zc = None


@dataclass(frozen=True)
class Found:
    """One advert as received: unverified."""

    service: str
    name: str
    addresses: tuple[str, ...]
    port: int
    id_port: int
    fingerprint: str
    version: str
    gpus: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["addresses"] = list(self.addresses)
        d["verified"] = False
        return d


def _txt(props: dict[bytes, bytes | None], key: str) -> str:
    v = props.get(key.encode())
    return v.decode("utf-8", "replace")[:200] if isinstance(v, bytes) else ""


def discover(timeout: float = 2.0, interfaces: Any = None) -> list[Found]:
    """Agents that answer an mDNS browse within `timeout` seconds (interfaces: zeroconf's; default all)."""
    names: set[str] = set()
    lock = threading.Lock()

    class _Listener(ServiceListener):
        def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            with lock:
                names.add(name)

        def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            with lock:
                names.add(name)

        def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            pass

    zc = Zeroconf(interfaces=interfaces or InterfaceChoice.All, ip_version=IPVersion.V4Only)
    try:
        browser = ServiceBrowser(zc, SERVICE_TYPE, _Listener())
        time.sleep(timeout)
        browser.cancel()
        with lock:
            found_names = sorted(names)
        out = []
        for n in found_names:
            info = zc.get_service_info(SERVICE_TYPE, n, timeout=1000)
            if info is None or not info.port:
                continue
            props = info.properties or {}
            idp = _txt(props, "idp")
            out.append(
                Found(
                    service=n,
                    name=_txt(props, "name") or n.split(".")[0],
                    addresses=tuple(info.parsed_addresses()),
                    port=int(info.port),
                    id_port=int(idp) if idp.isdigit() and 0 < int(idp) < 65536 else int(info.port) + 1,
                    fingerprint=_txt(props, "fp"),
                    version=_txt(props, "v"),
                    gpus=_txt(props, "gpus"),
                )
            )
        return out
    finally:
        zc.close()
