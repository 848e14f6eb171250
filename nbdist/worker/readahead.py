"""What the worker's read-ahead threads (Spark streams, PyDataset shares) share."""
from __future__ import annotations

import queue
import threading
from typing import Any


def put_until_stopped(q: queue.Queue, item: Any, stop: threading.Event, poll: float = 0.5) -> bool:
    """Put ``item`` into the bounded queue, waiting while it is full, unless the reader is stopped
    meanwhile (then False): a reader whose consumer has gone must not block its thread forever."""
    while not stop.is_set():
        try:
            q.put(item, timeout=poll)
            return True
        except queue.Full:
            continue
    return False
