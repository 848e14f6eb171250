"""Worker entry point: connect, authenticate, receive the job, train, report.

The same program runs under every backend; only how it is started differs.
The driver's address comes from ``--address``, the per-run secret as one hex line
on stdin (never the command line, which other users can read, nor the environment,
which ``podman inspect`` shows); see wire/secret.py.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import queue
import re
import socket
import sys
import threading
import time
import traceback
from typing import Any, TypeVar

from ..errors import NbdistError
from ..wire import protocol
from ..wire.catalog import read
from ..wire.codec import MessageError
from ..wire.commands import Heartbeat, Stop
from ..wire.reports import Hello, WorkerError

log = logging.getLogger("nbdist.worker")
T = TypeVar("T")


def read_secret(stream: Any = None) -> bytes | None:
    """The per-run secret from the first line of stdin; None if it is missing or malformed."""
    stream = stream if stream is not None else sys.stdin.buffer
    line = stream.readline(1024).strip()
    try:
        secret = bytes.fromhex(line.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return secret or None


class DriverLink:
    """The worker's side of the connection: a reader thread and a heartbeat thread.

    If the driver goes away (connection closed, or silent past the timeout) the
    worker exits at once: a worker never outlives its notebook.
    """

    def __init__(self, channel: protocol.Channel, heartbeat_interval: float = 2.0,
                 heartbeat_timeout: float = 60.0) -> None:
        self.channel = channel
        # Typed messages from the driver; a MessageError where one could not be read (raised by ``expect``).
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self._last_heard = time.monotonic()
        # Called (on the reader thread) when the driver stops the run asking for the weights
        # (rank 0 when weights travel only at the end: callbacks.WeightShipper.on_stop).
        self.on_stop: Any = None
        # Messages handled on the reader thread as they arrive, by type, never queued: a notice the training
        # thread reads between steps (an elastic run's JoinAtCommit, worker/elastic.py).
        self.handlers: dict[type, Any] = {}
        threading.Thread(target=self._read, name="nbdist-driver-reader", daemon=True).start()
        threading.Thread(target=self._beat, name="nbdist-heartbeat", daemon=True).start()

    def send(self, message: Any) -> None:
        """Send a typed message (wire/reports.py)."""
        self.channel.send(*message.encode())

    def error_report(self, exc: BaseException) -> WorkerError:
        """``exc`` as the driver reads a worker's failure (its line, traceback, and type where Keras raised it)."""
        typed = keras_raised(exc)
        tb = "".join(traceback.format_exception(exc))
        return WorkerError(type(exc).__name__, summarise(exc), tb, *(typed or (None, None)))

    def expect(self, kind: type[T], timeout: float) -> T:
        """The next message of type ``kind`` (others are dropped); a malformed one raises MessageError."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no '{kind.TYPE}' message from the driver within {timeout:.0f} s")
            try:
                msg = self.inbox.get(timeout=remaining)
            except queue.Empty:
                continue
            if isinstance(msg, MessageError):
                raise msg
            if isinstance(msg, kind):
                return msg
            log.debug("ignoring %s while waiting for %s", msg.TYPE, kind.TYPE)

    def _read(self) -> None:
        try:
            while True:
                received = self.channel.recv()
                self._last_heard = time.monotonic()
                try:
                    msg = read(received)
                except MessageError as exc:  # the job's thread fails with it and reports it
                    self.inbox.put(exc)
                    continue
                if isinstance(msg, Heartbeat):
                    continue
                if isinstance(msg, Stop):
                    log.info("driver asked this worker to stop")
                    if msg.weights and self.on_stop is not None:
                        try:
                            self.on_stop()
                        except Exception:  # the driver then keeps what it has; the worker ends all the same
                            log.exception("could not send the weights at the stop")
                    os._exit(0)
                handler = self.handlers.get(type(msg))
                if handler is not None:
                    handler(msg)
                    continue
                self.inbox.put(msg)
        except Exception as exc:  # closed or forged: either way the driver is gone for us
            if not self.channel.closed:
                log.error("lost the driver (%s); exiting", exc)
                os._exit(3)

    def _beat(self) -> None:
        while not self.channel.closed:
            time.sleep(self.heartbeat_interval)
            if self.channel.closed:  # closed while it slept: the link's owner ends the worker, not silence
                return
            if time.monotonic() - self._last_heard > self.heartbeat_timeout:
                log.error("driver silent for %.0f s; exiting", self.heartbeat_timeout)
                os._exit(4)
            try:
                self.send(Heartbeat())
            except Exception:
                return


# A worker that cannot connect to the coordinator logs this and exits with protocol.EXIT_UNREACHABLE;
# the driver then names the address and the setting to change.
UNREACHABLE = "cannot reach the notebook's coordinator at"

_GENERIC = ("Graph execution error", "Detected at node", "File ", "Exception encountered")


def summarise(exc: BaseException) -> str:
    """One informative line: TensorFlow buries the real message under generic headers. nbdist's own
    errors are sentences for the user, shown as they are."""
    lines = [ln for ln in user_code_message(str(exc), type(exc).__name__).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln[0].isspace() and not ln.startswith(_GENERIC)]
    head = (useful or lines or [""])[0].strip()
    if head.endswith("Traceback (most recent call last):") and len(useful) > 1:
        # A callback's error carried in the message (JAX's "CpuCallback error calling callback: Traceback ..."
        # around nbdist's gradient sum): the line that says why is the inner exception's, the last.
        head = useful[-1].strip()
    if isinstance(exc, NbdistError) and head:
        return head
    return f"{type(exc).__name__}: {head}" if head else type(exc).__name__


# The packages whose exceptions the notebook raises again as themselves (driver/failures.py rebuilds them).
_NBDIST_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NEUTRAL = ("site-packages", "dist-packages", os.path.dirname(os.__file__))


def keep_keras_frames() -> None:
    """Keras' frames stay in a worker's tracebacks: they tell its errors from nbdist's (``keras_raised``).
    Keras' traceback filtering stays on, as in the notebook, with nothing to filter out: it is what adds
    "Exception encountered when calling <layer>" to an error raised in a layer's call. A Keras without that
    private exclusion list gets the filtering turned off (the message then lacks that frame)."""
    import keras
    from keras.src.utils import traceback_utils

    if isinstance(getattr(traceback_utils, "_EXCLUDED_PATHS", None), tuple):
        traceback_utils._EXCLUDED_PATHS = ()
    else:
        keras.config.disable_traceback_filtering()


def keras_raised(exc: BaseException) -> tuple[str, str] | None:
    """(the type's module:qualname, its message) when ``exc`` is Keras' or the cell's to raise, not nbdist's.

    It is when its type is not nbdist's (a builtin, Keras', TensorFlow's, the cell's own or a library's) and
    the code that raised it is Keras' or the cell's: walking outward from where it was raised, the first
    frame of nbdist, Keras or the user's code decides (TensorFlow, numpy and the standard library only carry
    it). Where it was raised: for an
    error of TensorFlow's graph, the stack its message gives (a Python op's own traceback, else where the
    failing op was defined); else the exception's traceback. nbdist's own failures (its checks, a
    collective's timeout, a lost peer) stay nbdist's."""
    from ..wire.codec import MessageError

    kind = type(exc)
    if (not isinstance(exc, Exception) or isinstance(exc, (NbdistError, MessageError))
            or kind.__module__.split(".")[0] == "nbdist"):
        return None
    message = user_code_message(str(exc), kind.__name__)
    frames = _stack_in_message(message)
    if not frames:
        tb = exc.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
    keras_dir = os.path.dirname(os.path.abspath(__import__("keras").__file__))
    for path in reversed(frames):
        if path.startswith("<"):  # the cell's code ("<ipython-input-...>", cloudpickle's "<dynamic-code>")
            break
        path = os.path.abspath(path)
        if path.startswith(_NBDIST_DIR + os.sep):
            return None
        if path.startswith(keras_dir + os.sep) or not any(n in path for n in _NEUTRAL):
            break
    return f"{kind.__module__}:{kind.__qualname__}", message


def _stack_in_message(message: str) -> list[str]:
    """The files of the stack a TensorFlow graph error's text holds (a Python op's traceback, or where the
    failing op was defined), outermost first; none for another error."""
    for head in ("Traceback (most recent call last)", "defined at (most recent call last)"):
        start = message.rfind(head)
        if start >= 0:
            return re.findall(r'File "([^"]+)"', message[start:])
    return []


def user_code_message(message: str, name: str) -> str:
    """The exception's own message out of TensorFlow's "in user code:" wrapper (the frames of the traced
    function, then the original ``Name: message`` indented); other messages as they are."""
    if not message.startswith("in user code:"):
        return message
    lines = message.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if line.startswith("    ") and line[4:].startswith(f"{name}: "):
            rest = [ln[4:] if ln.startswith("    ") else ln for ln in lines[i + 1:]]
            return "\n".join([line[4 + len(name) + 2:], *rest]).rstrip()
    return message


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the process that started it dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        log.debug("prctl unavailable", exc_info=True)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nbdist.worker", description="nbdist training worker")
    p.add_argument("--address", help="driver coordinator HOST:PORT")
    p.add_argument("--rank", type=int, help="this worker's rank")
    p.add_argument("--warm-socket", metavar="PATH",
                   help="import everything first, then take a Spark task's job on this Unix socket "
                        "(spark/warm.py, worker/warm_socket.py)")
    p.add_argument("--watch", metavar="PID:START", help="with --warm-socket: exit when this process ends")
    p.add_argument("--fork-server", action="store_true",
                   help="import everything first, then fork a worker for each job read on stdin, answering on "
                        "stdout (backends/warm.py, worker/fork_server.py)")
    p.add_argument("--die-with-parent", action="store_true", help="exit when the parent process dies")
    args = p.parse_args(argv)
    if args.warm_socket and not args.watch:
        p.error("--warm-socket needs --watch")
    if not (args.warm_socket or args.fork_server) and (args.address is None or args.rank is None):
        p.error("--address and --rank are required unless --warm-socket or --fork-server")
    return args


def _import_for_training() -> None:
    """What a warm worker imports ahead of its job: the seconds it saves. Keras loads the backend
    KERAS_BACKEND names (TensorFlow only for its own); one whose package is missing is left for the job
    to report (``backend_problem``)."""
    import importlib.util

    from ..wire.handover import READY

    if importlib.util.find_spec("torch") is not None:  # the collectives' (a run without torch is told at the door)
        import torch.distributed  # noqa: F401

    if os.environ.get("NBDIST_WARM_IMPORTS") == "device-free":  # GPUs: no Keras (placement.warm_server_env)
        log.info("warm: imports that initialise no device only (GPUs: each worker imports Keras itself)")
    elif backend_problem() is None:
        from .runtime import import_keras

        import_keras()
        from . import allreduce_fit, training  # noqa: F401
    log.info("%s", READY)


def backend_problem() -> str | None:
    """One sentence when this worker cannot run the notebook's Keras backend (its package is absent)."""
    from ..machine.keras_backend import configured_backend, missing_package

    return missing_package(configured_backend())


def _take_job(line: bytes) -> tuple[str, int]:
    """(address, rank) from a warm worker's job line; sets the environment variables it carries."""
    try:
        job = json.loads(line)
        env, address, rank = job.get("env", {}), str(job["address"]), int(job["rank"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError("malformed job line; a warm worker must be started by nbdist") from exc
    os.environ.update({str(k): str(v) for k, v in env.items()})
    return address, rank


def _forked_work(job: bytes, secret: bytes) -> int:
    """A worker forked by the fork server: its job line (which sets its environment), then its work."""
    address, rank = _take_job(job)
    return _work(address, rank, secret)


def wait_warm_socket(path: str, watch: str) -> tuple[str, int, bytes, socket.socket] | None:
    """A warm worker on a Spark executor (spark/warm.py, worker/warm_socket.py): import, then wait for a task.

    Returns (address, rank, secret line, the task's connection), or None when the executor went
    away or nobody came. Once taken, the worker dies with that connection, as a child started
    with ``--die-with-parent`` dies with its task.
    """
    from ..machine.processes import ProcessId
    from . import warm_socket

    pid, start = (int(v) for v in watch.split(":"))
    listener = warm_socket.listen(path)
    _import_for_training()
    taken = warm_socket.serve_one(listener, path, lambda: ProcessId(pid, start).alive())
    if taken is None:
        return None
    conn, job, secret = taken
    address, rank = _take_job(job)
    conn.sendall(f"pid {os.getpid()}\n".encode())
    threading.Thread(target=_die_with_connection, args=(conn,), name="nbdist-task-link", daemon=True).start()
    return address, rank, secret, conn


_finished = threading.Event()  # set before the exit line: the task may then close the connection


def _die_with_connection(conn: socket.socket) -> None:
    try:
        while conn.recv(1024):
            pass
    except OSError:
        pass
    if not _finished.is_set():
        log.error("the Spark task that took this worker is gone; exiting")
        os._exit(3)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s worker %(process)d %(levelname)s %(message)s")
    args = _parse(argv)
    if args.die_with_parent:
        parent = os.getppid()
        _die_with_parent()
        if os.getppid() != parent:
            return 5
    if args.fork_server:
        from .fork_server import serve

        answers = os.dup(1)  # the answers' channel; anything else printed goes to the log
        os.dup2(2, 1)
        _import_for_training()
        return serve(answers, _forked_work)
    task: socket.socket | None = None  # a Spark task's connection, when it took this warm worker
    secret_line = None
    try:
        if args.warm_socket:
            taken = wait_warm_socket(args.warm_socket, args.watch)
            if taken is None:
                return 0
            args.address, args.rank, secret_line, task = taken
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    secret = read_secret(io.BytesIO(secret_line + b"\n") if secret_line is not None else None)
    if secret is None:
        log.error("no secret on stdin; a worker must be started by nbdist")
        return 2
    code = 1
    try:
        code = _work(args.address, args.rank, secret)
    except Exception:  # e.g. the driver unreachable: in the log before the task hears the code
        log.error("worker failed:\n%s", traceback.format_exc())
    finally:
        if task is not None:  # the task waits for this line as it would wait for its child
            _finished.set()
            try:
                task.sendall(f"exit {code}\n".encode())
            except OSError:
                pass
    return code


def _work(address: str, rank: int, secret: bytes) -> int:
    host, _, port = address.rpartition(":")
    try:
        channel = protocol.connect((host, int(port)), secret)
    except OSError as exc:  # refused, no route, timed out: say where from and to, not a traceback
        why = exc.strerror or type(exc).__name__
        log.error("%s %s:%s from %s: %s", UNREACHABLE, host, port, socket.gethostname(), why)
        return protocol.EXIT_UNREACHABLE
    link = DriverLink(channel)
    link.send(Hello(rank, os.getpid(), socket.gethostname()))
    try:
        problem = backend_problem()
        if problem is not None:
            raise NbdistError(problem)
        from .runtime import import_keras, unpack_job

        import_keras()  # first, before anything imports Keras with its optional packages
        keep_keras_frames()

        from ..wire.messages import JobMessage

        job = unpack_job(link.expect(JobMessage, timeout=300))
        if job.kind == "train":
            from .phases import time_phases
            from .training import run_training

            time_phases(job.train.phase_times)
            run_training(link, job)
        else:  # evaluate / predict
            from .inference import run_inference

            run_inference(link, job)
    except BaseException as exc:  # report everything, including KeyboardInterrupt/SystemExit
        tb = traceback.format_exc()
        log.error("training failed:\n%s", tb)
        try:
            typed = keras_raised(exc)
            link.send(WorkerError(type(exc).__name__, summarise(exc), tb, *(typed or (None, None))))
        except Exception:
            pass
        channel.closed = True
        channel.close()
        return 1
    channel.closed = True
    channel.close()
    return 0
