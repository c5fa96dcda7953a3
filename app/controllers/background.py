"""Run a slow call (GPU probe, disk scan, download) on a worker thread and get its result back on the GUI thread.

The worker never touches Qt: PySide6 6.8+ corrupts reference counts when Python objects cross threads through a
signal (PYSIDE-3124). A timer on the GUI thread watches the future and emits the result from there.
"""

import concurrent.futures
from collections import deque
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal

POLL_MS = 20
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="strata-job")
_jobs: set["Job"] = set()


class Job(QObject):
    """`done(result)` or `failed(message)`, emitted on the GUI thread. `progress` is for jobs that report some."""

    done = Signal(object)
    failed = Signal(str)
    progress = Signal(object)

    def __init__(self) -> None:
        super().__init__()
        self.future: concurrent.futures.Future[Any] | None = None
        self.finished = False
        self._progress: deque[Any] = deque()
        self._timer = QTimer(self)
        self._timer.timeout.connect(self._check)
        self._timer.start(POLL_MS)

    def report(self, value: Any) -> None:
        """Called from the worker thread: queued and emitted as `progress` on the GUI thread."""
        self._progress.append(value)

    def _check(self) -> None:
        while self._progress:
            self.progress.emit(self._progress.popleft())
        if self.future is None or not self.future.done():
            return
        self._timer.stop()
        self.finished = True
        _jobs.discard(self)
        exc = self.future.exception()
        if exc is None:
            self.done.emit(self.future.result())
        else:  # the GUI shows the message; it never shows a traceback
            self.failed.emit(str(exc) or type(exc).__name__)


def run_in_thread(
    fn: Callable[..., Any],
    on_done: Callable[[Any], None] | None = None,
    on_failed: Callable[[str], None] | None = None,
    on_progress: Callable[[Any], None] | None = None,
) -> Job:
    """Start `fn()` on the worker pool (`fn(report)` when `on_progress` is given: `report(value)` from the worker
    arrives as `on_progress(value)`); the callbacks run on the GUI thread."""
    job = Job()
    _jobs.add(job)
    if on_done is not None:
        job.done.connect(on_done)
    if on_failed is not None:
        job.failed.connect(on_failed)
    if on_progress is not None:
        job.progress.connect(on_progress)
        job.future = _pool.submit(fn, job.report)
    else:
        job.future = _pool.submit(fn)
    return job
