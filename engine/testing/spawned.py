"""A program started for a test or a benchmark (a stage worker, an echo worker): its stderr read on a thread of its
own (kept, so that the pipe never fills and blocks it), the port named by the first line matching a pattern, and a
stop that ends it even when it is frozen or does not answer SIGTERM."""

import re
import signal
import subprocess
import threading
from pathlib import Path


class Spawned:
    def __init__(self, cmd: list[str], env: dict[str, str], pattern: str, cwd: Path) -> None:
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
        )
        self.port = 0
        self.log: list[str] = []
        self.ready = threading.Event()  # the port was found, or the program ended
        threading.Thread(target=self._read, args=(self.proc, re.compile(pattern)), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str], pattern: re.Pattern[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.log.append(line.rstrip())
            m = pattern.search(line)
            if m and not self.ready.is_set():
                self.port = int(m.group(1))
                self.ready.set()
        self.ready.set()

    def wait_port(self, timeout: float) -> int:
        """The port, once the program has named it; stopped, with its last lines in the error, if it does not in
        `timeout` seconds or exits first."""
        if not self.ready.wait(timeout):
            self.stop()
            raise TimeoutError("the worker did not start:\n" + "\n".join(self.log[-20:]))
        if not self.port:
            self.stop()
            raise RuntimeError("the worker exited:\n" + "\n".join(self.log[-20:]))
        return self.port

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            if hasattr(signal, "SIGCONT"):  # a frozen program would not see the SIGTERM
                self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for s in (self.proc.stderr, self.proc.stdout):
            if s is not None:
                s.close()
