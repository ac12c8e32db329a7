"""The daemon's side of a worker process (``peer/worker.py``), without torch: start it with
``subprocess`` (not fork: the daemon has gRPC threads), ask it things over JSON lines, and say
why it died when it does.

A worker that exits or is killed mid-request (a crash, SIGKILL, the kernel's out-of-memory
killer: return code -9) raises ``WorkerDied`` whose message names the exit code or signal and
the last lines the worker wrote to stderr; the caller fails or retries its run by the run's
rules. ``close()`` ends a worker (stdin closed, then SIGTERM, then SIGKILL) and frees the host
slot (``peer/slots.py``) it holds.
"""

from __future__ import annotations

import collections
import json
import queue
import signal
import subprocess
import sys
import threading

__all__ = ["WorkerDied", "WorkerError", "WorkerProcess"]


class WorkerDied(RuntimeError):
    """The worker process ended before answering; the message says how (code, signal, stderr)."""


class WorkerError(RuntimeError):
    """The worker answered a request with an error (``"Type: message"``)."""


class WorkerProcess:
    """One ``python -m fedrelay.peer.worker`` child. ``slot``: a ``peer.slots.Slot`` it holds
    (released by ``close``); ``stderr_lines``: how many of its last stderr lines to keep."""

    def __init__(self, slot=None, stderr_lines: int = 20, env: dict | None = None):
        self.slot = slot
        self._tail: collections.deque[str] = collections.deque(maxlen=stderr_lines)
        self._answers: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen([sys.executable, "-m", "fedrelay.peer.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                     env=env, close_fds=True)
        self._lock = threading.Lock()  # one request at a time
        threading.Thread(target=self._read_stdout, daemon=True, name=f"worker-{self.proc.pid}-out").start()
        threading.Thread(target=self._read_stderr, daemon=True, name=f"worker-{self.proc.pid}-err").start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            try:
                self._answers.put(json.loads(line))
            except ValueError:
                self._tail.append(f"(stdout) {line.rstrip()}")
        self._answers.put(None)  # end of stream: the worker is gone

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._tail.append(line.rstrip())

    def reason(self) -> str:
        """How the worker ended: ``exit code N`` or ``killed by SIGNAME`` (``-9``: SIGKILL, e.g.
        the out-of-memory killer), and its last stderr lines."""
        code = self.proc.wait()
        if code < 0:
            name = signal.Signals(-code).name
            how = f"killed by {name}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
        else:
            how = f"exit code {code}"
        tail = "; ".join(line for line in self._tail if line)[-1500:]
        return how + (f"; last stderr: {tail}" if tail else "")

    def request(self, req: dict, timeout: float | None = None) -> dict:
        """Send one request and wait for its answer. Raises ``WorkerDied`` (the worker ended
        first), ``WorkerError`` (it answered an error) or ``TimeoutError``."""
        with self._lock:
            try:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # the answer queue says it ended
            try:
                answer = self._answers.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"worker {self.pid} did not answer {req.get('op')!r} in {timeout} s") from None
        if answer is None:
            self._answers.put(None)
            raise WorkerDied(f"worker process {self.pid} ended during {req.get('op')!r}: {self.reason()}")
        if answer.get("event") == "error":
            raise WorkerError(answer.get("error", "unknown error"))
        return answer

    def close(self, grace: float = 5.0) -> None:
        """End the worker (idempotent) and release its slot."""
        try:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
                try:
                    self.proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    self.proc.terminate()
                    try:
                        self.proc.wait(timeout=grace)
                    except subprocess.TimeoutExpired:
                        self.proc.kill()
                        self.proc.wait()
        finally:
            if self.slot is not None:
                self.slot.release()
