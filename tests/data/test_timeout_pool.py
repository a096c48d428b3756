"""TimeoutPool's workers are real processes: one that is gone at any moment (killed between items, or while working
on one) is replaced and its item sent again; an item that kills every worker it reaches fails alone."""

from __future__ import annotations

import math
import os
import threading
import time

from qerl.data.timeout_pool import TimeoutPool


def test_a_worker_killed_between_items_is_replaced_and_the_next_items_are_scored():
    pool = TimeoutPool(math.sqrt, num_workers=2, timeout_s=60)
    try:
        assert pool.map([(4.0,)] * 3) == [("ok", 2.0)] * 3
        killed = [w.process for w in pool._workers]
        for process in killed:  # gone while idle, as a worker the OS or a user ended
            process.kill()
            process.wait()
        assert pool.map([(9.0,)] * 5) == [("ok", 3.0)] * 5
        assert not {w.process.pid for w in pool._workers} & {p.pid for p in killed}
    finally:
        pool.close()


def test_a_worker_killed_while_working_is_replaced_and_its_item_sent_again():
    pool = TimeoutPool(time.sleep, num_workers=1, timeout_s=60)
    try:
        pool.map([(0.0,)])  # the worker is up
        worker = pool._workers[0]

        def kill_when_busy():
            while worker.item is None:
                time.sleep(0.01)
            worker.process.kill()

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        assert pool.map([(1.0,)]) == [("ok", None)]
        killer.join()
        assert pool._workers[0] is not worker
    finally:
        pool.close()


def test_an_item_that_kills_every_worker_fails_alone():
    pool = TimeoutPool(os._exit, num_workers=1, timeout_s=60)
    try:
        assert pool.map([(3,)]) == [("error", "worker process died")]
    finally:
        pool.close()
