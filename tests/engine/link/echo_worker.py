"""A torch-free stage worker for link tests: `StageServer` with a compute that returns its input.

python -m tests.engine.link.echo_worker BIND PORT     (keys from STRATA_STAGE_TOKEN)
"""

import os
import signal
import sys
import time

from engine.link.keys import server_keys
from engine.link.server import StageServer
from tests.engine.link.harness import ECHO_INFO


class Echo:
    """Returns its input; `ECHO_MS_PER_TOKEN` makes it take that long per token (a request to interrupt)."""

    def __init__(self, ms_per_token: float = 0.0) -> None:
        self.ms = ms_per_token

    def open(self, max_ctx: int, kv: str, slots: int = 1) -> None:
        pass

    def forward(
        self, payload: memoryview | bytes, dtype: str, shape: tuple[int, ...], rows: object
    ) -> tuple[bytes, str, tuple[int, ...]]:
        if self.ms:
            time.sleep(self.ms * shape[0] / 1e3)
        return bytes(payload), dtype, shape


def main() -> None:
    bind, port = sys.argv[1], int(sys.argv[2])
    echo = Echo(float(os.environ.get("ECHO_MS_PER_TOKEN", "0")))
    server = StageServer(ECHO_INFO, echo, server_keys(None, []), bind, port)

    def stop(signum: int, frame: object) -> None:
        server.request_stop()

    signal.signal(signal.SIGTERM, stop)
    print(f"echo worker on {bind}:{server.port}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
