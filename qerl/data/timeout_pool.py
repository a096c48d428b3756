"""A pool of worker processes that runs each call under a hard wall-clock limit, from any thread.

Why processes: a runaway sympy simplification (``verify("3", "9^{9^{9^{9^{9}}}}")`` never returns) cannot be
interrupted inside the process that runs it: ``signal.alarm`` (math-verify's own timeout) only works in the main
thread, and a thread cannot be killed. A worker that passes its deadline is killed and replaced, so one bad item
costs ``timeout_s`` plus a restart in the background, never a hang.

Workers are fresh interpreters (``subprocess``: no fork of a process that holds CUDA contexts or torch threads, and
unlike multiprocessing's ``spawn`` no re-import of the caller's ``__main__``, so scripts need no ``if __name__`` guard
and a worker does not import torch). A worker reports ready only after importing ``fn``'s module, so import time
never counts against an item's limit.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

_READY = "ready"
_DIED = ("died", None)  # a worker's process is gone (what it worked on is sent again)
_START_TIMEOUT_S = 300.0


def _exit_with_parent(parent: int) -> None:
    # A worker stuck in a computation never reads EOF: leave when the parent is gone (re-parented), whatever it does.
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _serve(read_fd: int, write_fd: int) -> None:
    """A worker's main loop: receive ``(sys.path, module, name)``, then argument tuples until ``None`` or EOF."""
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches the whole group: the parent decides
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    path, module, name = inbox.recv()
    sys.path[:] = path
    fn = getattr(importlib.import_module(module), name)
    outbox.send(_READY)
    while True:
        try:
            args = inbox.recv()
        except EOFError:  # the parent is gone
            return
        if args is None:
            return
        try:
            outbox.send(("ok", fn(*args)))
        except Exception as e:  # noqa: BLE001 - the item fails, the worker lives on
            outbox.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    """One worker process and the two pipes to it."""

    def __init__(self, fn: Callable):
        child_in, parent_out = os.pipe()
        parent_in, child_out = os.pipe()
        code = f"from qerl.data.timeout_pool import _serve; _serve({child_in}, {child_out})"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(child_in, child_out), env=env)
        os.close(child_in)
        os.close(child_out)
        self.inbox = Connection(parent_in, writable=False)
        self.outbox = Connection(parent_out, readable=False)
        self.outbox.send((sys.path, fn.__module__, fn.__qualname__))
        self.started = time.monotonic()
        self.ready = False
        self.item: int | None = None  # index of the item it is working on
        self.since = 0.0

    def kill(self) -> None:
        with contextlib.suppress(OSError):  # already gone
            self.process.kill()
        self.process.wait(timeout=5)
        self.inbox.close()
        self.outbox.close()


class TimeoutPool:
    """Runs ``fn(*args)`` for many argument tuples in ``num_workers`` processes, each call limited to ``timeout_s``.

    Args:
        fn: A module-level (picklable) function.
        num_workers: Worker processes.
        timeout_s: Wall-clock limit of one call, counted from when a ready worker receives it.
    """

    def __init__(self, fn: Callable, num_workers: int = 2, timeout_s: float = 2.0):
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"TimeoutPool needs num_workers >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}.")
        self.fn, self.num_workers, self.timeout_s = fn, num_workers, timeout_s
        self._workers: list[_Worker] = []

    def map(self, items: Sequence[tuple]) -> list[tuple[str, Any]]:
        """One ``("ok", result)``, ``("error", message)`` or ``("timeout", None)`` per item, in order.

        A worker found gone at any moment (between items, or while working on one) is replaced and its item sent
        again, once: only an item whose worker dies twice scores ``("error", "worker process died")``."""
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self.fn))
        todo, results = deque(range(len(items))), [None] * len(items)
        deaths: Counter[int] = Counter()  # item -> workers that died holding it
        while todo or any(w.item is not None for w in self._workers):
            for i, w in enumerate(self._workers):
                if w.ready and w.item is None and todo:
                    w.item, w.since = todo.popleft(), time.monotonic()
                    try:
                        w.outbox.send(items[w.item])
                    except OSError:  # BrokenPipeError: the process is gone; the next one gets the item
                        todo.appendleft(w.item)
                        w.item = None
                        self._replace(i)
            wait([w.inbox for w in self._workers], timeout=self._next_deadline())
            for i, w in enumerate(self._workers):
                outcome, alive = self._poll(w)
                if outcome == _DIED and w.item is not None:
                    deaths[w.item] += 1
                    if deaths[w.item] < 2:
                        todo.appendleft(w.item)
                        w.item, outcome = None, None
                    else:
                        outcome = ("error", "worker process died")
                if outcome is not None and w.item is not None:
                    results[w.item], w.item = outcome, None
                if not alive:  # dead or stuck: replace it; the new one starts while the others work
                    self._replace(i)
        return results

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self.fn)

    def _poll(self, w: _Worker) -> tuple[tuple[str, Any] | None, bool]:
        """``(result or None, worker still usable)`` for one worker, without blocking."""
        now = time.monotonic()
        try:
            if w.inbox.poll():
                message = w.inbox.recv()
                if message == _READY:
                    w.ready = True
                    return None, True
                return message, True
        except (EOFError, OSError):
            if not w.ready and w.process.wait(timeout=5) >= 0:  # it exited by itself (a signal is replaced)
                raise RuntimeError(f"A TimeoutPool worker for {self.fn.__module__} died while starting.") from None
            return _DIED, False
        if w.item is not None and now - w.since > self.timeout_s:
            return ("timeout", None), False
        if not w.ready and now - w.started > _START_TIMEOUT_S:
            raise RuntimeError(f"A TimeoutPool worker for {self.fn.__module__} did not start in {_START_TIMEOUT_S} s.")
        return None, True

    def _next_deadline(self) -> float:
        busy = [w.since + self.timeout_s for w in self._workers if w.item is not None]
        return max(0.0, min(busy) - time.monotonic()) if busy else 1.0

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def __getstate__(self) -> dict:
        # Copies and checkpoints carry the settings, never the processes: a copy starts its own on its first map.
        return {**self.__dict__, "_workers": []}

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter shutdown; the workers exit on EOF anyway
            self.close()
