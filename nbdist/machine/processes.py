"""Helpers for the processes nbdist starts or watches: who a process is, its cores, its log, its end.

Shared by the notebook side (local and warm workers), Spark tasks on executors and the workers
themselves, so it imports only the standard library.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LOG_TAIL_BYTES = 65536  # how much of a log's end is read for its last lines


@dataclass(frozen=True)
class ProcessId:
    """A process as another process of the same machine can check it: pid and start time."""

    pid: int
    start: int  # clock ticks after boot (/proc/<pid>/stat field 22): a reused pid differs

    @staticmethod
    def of(pid: int) -> ProcessId | None:
        """The running process ``pid`` (None: there is none, or it has exited and awaits its parent)."""
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return None
        # Field 2 (the command) is in parentheses and may hold spaces; count from its end.
        fields = stat[stat.rindex(b")") + 2:].split()
        if fields[0] in (b"Z", b"X"):  # dead; a zombie's entry stays until its parent reaps it
            return None
        return ProcessId(pid, int(fields[19]))

    def alive(self) -> bool:
        return ProcessId.of(self.pid) == self


def read_log_tail(path: str | os.PathLike[str], lines: int = 20) -> str:
    """The last ``lines`` of a worker's log file, reading only its final 64 KiB ("" if unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group a worker leads (started with ``start_new_session``).

    A group already gone, or not ours to signal, needs nothing more.
    """
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def pin_to_cores(pid: int, cores: set[int]) -> None:
    """Bind a worker to ``cores``: every thread it has now; threads created later inherit the mask.

    A warm worker already runs the threads its imports started, so each is pinned by its id.
    """
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    try:
        for tid in threads:
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:  # a thread that ended meanwhile
                continue
    except OSError as exc:  # the child already exited, or a restricted container: run unpinned
        log.warning("could not pin worker pid %d to cores %s: %s", pid, sorted(cores), exc)


def remove_quietly(path: str | os.PathLike[str]) -> None:
    """Delete a file that may already be gone (a socket, a log, a shared-memory segment)."""
    try:
        Path(path).unlink()
    except OSError:
        pass


# -- how a process ended: the out-of-memory killer -----------------------------
def oom_kill_count() -> int | None:
    """Processes the kernel's out-of-memory killer has killed since boot (cgroup limits included), or None."""
    try:
        with open("/proc/vmstat", "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


@dataclass
class ChildEnd:
    """How a child process ended: its exit code (negative: the signal), peak RSS, and whether the
    out-of-memory killer ended it (a SIGKILL while the kernel's count of such kills went up)."""

    code: int
    peak_rss: int | None = None  # bytes
    oom_killed: bool = False


def reap(pid: int, oom_kills_before: int | None, block: bool = False) -> ChildEnd | None:
    """Reap child ``pid`` with its resource usage (os.wait4), None while it runs. Its peak RSS comes from
    the kernel's accounting, which a killed process no longer can report itself."""
    try:
        got, status, usage = os.wait4(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return None
    if got == 0:
        return None
    code = os.waitstatus_to_exitcode(status)
    return ChildEnd(code, usage.ru_maxrss * 1024, oom_killed(code, oom_kills_before))


def oom_killed(code: int, oom_kills_before: int | None) -> bool:
    """Whether a child that ended with ``code`` was the out-of-memory killer's: a SIGKILL while the
    kernel's count of such kills went up since ``oom_kills_before``."""
    after = oom_kill_count()
    return code == -9 and oom_kills_before is not None and after is not None and after > oom_kills_before


def oom_sentence(peak_rss: int | None) -> str:
    """What a worker killed by the out-of-memory killer is told, after its name."""
    peak = f" after reaching {peak_rss / 2**20:,.0f} MB" if peak_rss else ""
    return (f"was killed by the out-of-memory killer{peak} (SIGKILL); give it less to hold: a smaller "
            "--stream-buffer (Spark data) or --batch-size, fewer --workers on one machine, or more memory")
