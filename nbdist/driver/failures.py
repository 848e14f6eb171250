"""How a worker's end is told: the sentence for its exit, the exception it raised, its last traceback,
and which of several ended workers is the likely cause (pure functions over worker handles)."""
from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import worker_raised
from ..machine.processes import oom_sentence

# Spark aborts a failed barrier ResultStage rather than retrying it ("Could not recover from a failed barrier
# ResultStage"), whatever spark.task.maxFailures allows; nbdist's own relaunch writes every partition afresh.
LOST_TASK = ("was lost with its Spark task (its Python process or executor died; Spark does not retry a barrier "
             "stage, so rerun, or pass --max-restarts N to relaunch the run from its last epoch)")


# What a worker raises when a peer's end closed their collective's connections (Gloo's words): a symptom, whose
# cause is that peer's own error.
PEER_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_symptom(text: str) -> bool:
    """Whether a worker's error says only that a peer's end broke the collective."""
    return any(words in text for words in PEER_SYMPTOMS)


def describe_exit(code: int, handle: Any = None) -> str:
    """How a worker ended, in words; the out-of-memory killer named when its handle knows it was that."""
    end = getattr(handle, "end", None)
    if end is not None and end.oom_killed:
        return oom_sentence(end.peak_rss)
    if getattr(handle, "lost", False):  # a Spark task that died without reporting (spark/backend.py)
        return getattr(handle, "lost_why", "") or LOST_TASK
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def raised(worker_traceback: str) -> str:
    """': <the exception>' from a worker's traceback (its last line), so the message says why."""
    if not worker_traceback.startswith("Traceback"):
        return ""
    lines = [line.strip() for line in worker_traceback.strip().splitlines() if line.strip()]
    return f": {first_line(lines[-1])}" if len(lines) > 1 else ""


def first_line(text: str, limit: int = 200) -> str:
    """The head of an exception message: the whole of it is in the worker's traceback."""
    line = text.strip().splitlines()[0] if text.strip() else "error"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def last_traceback(log_text: str, fallback_lines: int = 30) -> str:
    """The last whole Python traceback in a worker's log, else the log's last lines.

    A worker logs its traceback before it exits; TensorFlow's can run to hundreds of lines,
    so a fixed-size tail would cut off its head ("Traceback (most recent call last)").
    """
    start = log_text.rfind("Traceback (most recent call last)")
    if start >= 0:
        return log_text[start:]
    return "\n".join(log_text.splitlines()[-fallback_lines:])


def likely_causes_first(handles: Sequence[Any]) -> list[Any]:
    """Workers in the order their ends are looked at: a lost Spark task's worker first (Spark then cancelled
    its peers' tasks, which end at the same moment), then one killed or crashed, then the rest by rank (one
    that exited 1 raised, often because a peer's death broke the collective)."""
    return sorted(handles, key=lambda h: (not getattr(h, "lost", False), h.exit_status() in (None, 0, 1), h.rank))


def rebuild(raised_type: str, message: str, worker_traceback: str, rank: int | None) -> BaseException | None:
    """The exception a worker reported (``module:qualname``, worker/main.py keras_raised) as the notebook
    raises it: exactly that type, its own message, where it was raised beside it. The class is looked up by name
    in a module already imported here (``__main__``: the notebook's own classes); nothing is imported or unpickled
    for a name from the network, and nbdist's own exceptions are not taken. None where there is none, or it
    cannot be made from its message alone."""
    module_name, _, qualname = raised_type.partition(":")
    if module_name.split(".")[0] == "nbdist" or not qualname:
        return None
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None) if found is not None and not part.startswith("__") else None
    if not isinstance(found, type) or not issubclass(found, Exception):
        return None
    args: tuple[Any, ...] = (message,)
    op_error = getattr(sys.modules.get("tensorflow.python.framework.errors_impl"), "OpError", None)
    if op_error is not None and issubclass(found, op_error):  # TensorFlow's: (node_def, op, message)
        args = (None, None, message)
    try:
        return worker_raised(found, *args, worker_traceback=worker_traceback, rank=rank)
    except Exception:  # a class that needs more than its message
        return None
