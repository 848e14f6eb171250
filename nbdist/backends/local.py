"""Local backend: N worker processes on this machine, each in its own process group; ``add_worker`` starts one
more after launch (an elastic run's replacement) in a lost worker's place."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..config import default_local_workers
from ..machine import placement
from ..machine.placement import count_host_gpus, local_gpu_env, shared_core_slices, usable_cores
from ..machine.processes import ChildEnd, oom_kill_count, pin_to_cores, read_log_tail, reap, signal_group
from ..wire.secret import hand_over
from .command import job_command, worker_env
from .warm import POOL, ForkedWorker, worker_end

log = logging.getLogger(__name__)


def start_warm_workers(workers: int | None = None) -> None:
    """Start the fork server the workers of local jobs will come from (backends/warm.py), when
    ``workers`` of them share the machine: a default job's by default, a search's parallel trials'
    (parallel x workers per trial) when it starts. A live one for them is kept, not started again.

    With GPUs the server imports only what initialises no device (``placement.warm_server_env``). (Not
    with Spark active: the extension loader does not call this then; nor when warm workers are off:
    TrainConfig.warm_workers.)
    """
    threads = placement.threads_per_worker(workers or default_local_workers())
    POOL.server({**worker_env(threads), **placement.warm_server_env(count_host_gpus())})


class LocalWorker:
    def __init__(self, rank: int, proc: subprocess.Popen | ForkedWorker, log_path: Path) -> None:
        self.rank = rank
        self.proc = proc
        self.log_path = log_path
        self._oom_kills = oom_kill_count()
        self.end: ChildEnd | None = None  # how it ended, once reaped

    def exit_status(self) -> int | None:
        if self.end is None and self.proc.returncode is None:
            forked = isinstance(self.proc, ForkedWorker)  # its parent, the fork server, reaps it
            self.end = worker_end(self.proc, self._oom_kills) if forked else reap(self.proc.pid, self._oom_kills)
            if self.end is not None:  # reaped here: Popen must not wait for it again
                self.proc.returncode = self.end.code
        return self.proc.poll()

    def describe(self) -> str:
        return f"worker {self.rank} (pid {self.proc.pid})"

    def log_tail(self, lines: int = 20) -> str:
        return read_log_tail(self.log_path, lines)

    def signal(self, sig: int) -> None:
        signal_group(self.proc.pid, sig)


class LocalBackend:
    name = "local"
    bind_host = "127.0.0.1"
    advertise_host = "127.0.0.1"
    gloo_ifname: str | None = "lo"
    store_on_link = False
    unreachable_hint = ""  # the coordinator listens on this machine's loopback

    def __init__(self, share: int = 1, slot: int = 0, warm: bool = True) -> None:
        # This run is one of ``share`` using the machine at once, the one numbered ``slot``
        # (TrainConfig.local_share / local_slot): its workers are pinned to that share's cores. ``warm``
        # (TrainConfig.warm_workers): its workers fork from a fork server (backends/warm.py), else start afresh.
        self.share, self.slot, self.warm = share, slot, warm
        self.workers: list[LocalWorker] = []
        self.run_dir: Path | None = None
        self.workers_notice: str | None = None  # how many workers by default, and why (GPUs)
        # What launch() decided, for a worker added later (add_worker): environment, world, cores, fork server.
        self._env: dict[str, str] = {}
        self._world = 0
        self._slices: list[set[int]] | None = None
        self._server: Any = None

    def default_workers(self) -> int:
        """One worker per visible GPU where there are GPUs (said once, as the run starts), else the CPU default."""
        gpus = placement.visible_gpu_count(count_host_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        count, self.workers_notice = placement.default_worker_count(gpus, default_local_workers())
        return count

    def launch(self, world_size: int, address: tuple[str, int], secret: bytes,
               threads_per_worker: int, data: Any = None) -> list[LocalWorker]:
        """``data`` is for the Spark backend; here the data travels in the job messages."""
        self.run_dir = Path(tempfile.mkdtemp(prefix="nbdist-run-"))
        self._env = worker_env(threads_per_worker)
        self._world = world_size
        cores = usable_cores()
        self._slices = (shared_core_slices(cores, world_size, threads_per_worker, self.share, self.slot)
                        if cores else None)
        # With GPUs the server has imported nothing that picks a device: each worker's job sets its GPU first.
        self._server = POOL.server({**self._env, **placement.warm_server_env(count_host_gpus())}) if self.warm else None
        forked = sum(self._start(rank, rank, address, secret) for rank in range(world_size))
        log.info("started %d local workers (%d forked from a warm server)%s, logs in %s", world_size, forked,
                 f" pinned to cores {[sorted(c) for c in self._slices]}" if self._slices else "", self.run_dir)
        return list(self.workers)

    def add_worker(self, rank: int, like: int, address: tuple[str, int], secret: bytes) -> LocalWorker:
        """One more worker, ``rank``, after ``launch``, in launch rank ``like``'s place: its cores, its GPU and its
        thread budget (an elastic run's replacement, driver/training.py)."""
        if self.warm:  # the pool's live server (a fork that failed at launch started afresh: try again)
            self._server = POOL.server({**self._env, **placement.warm_server_env(count_host_gpus())})
        self._start(rank, like, address, secret)
        log.info("started local worker %d in worker %d's place", rank, like)
        return self.workers[-1]

    def remove_worker(self, rank: int) -> None:
        """End worker ``rank``, which an elastic run went on without (it went silent): SIGKILL, as ``stop`` ends one
        that outlives its grace."""
        for w in self.workers:
            if w.rank == rank and w.exit_status() is None:
                w.signal(signal.SIGKILL)

    def _start(self, rank: int, like: int, address: tuple[str, int], secret: bytes) -> bool:
        """Worker ``rank`` on launch rank ``like``'s cores and GPU, forked from the warm server when there is one;
        whether it was forked."""
        gpu_env = local_gpu_env(like, world=self._world)  # one GPU per worker by local rank, if any
        log_path = self.run_dir / f"worker-{rank}.log"
        proc: subprocess.Popen | ForkedWorker | None = None
        if self._server is not None:
            job = {"address": f"{address[0]}:{address[1]}", "rank": rank, "env": {**self._env, **gpu_env}}
            try:
                proc = self._server.fork(job, secret, log_path)
            except OSError as exc:  # the rest start cold: slower, and their own logs say why if they fail
                log.warning("%s; starting workers afresh instead", exc)
                self._server.stop()  # the pool starts another for the next job
                self._server = None
        forked = proc is not None
        if proc is None:
            with open(log_path, "wb") as out:
                proc = subprocess.Popen(
                    job_command(address, rank, die_with_parent=True),
                    env={**self._env, **gpu_env}, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,  # a terminal's Ctrl-C reaches the driver only; it stops us
                )
            hand_over(proc, secret)
        if self._slices is not None:
            pin_to_cores(proc.pid, self._slices[like])
        self.workers.append(LocalWorker(rank, proc, log_path))
        return forked

    def partition_rows(self) -> list[int] | None:
        return None  # the data travels in the job messages: nothing for tasks to count

    def stop(self, grace: float = 3.0) -> None:
        alive = [w for w in self.workers if w.exit_status() is None]
        for w in alive:
            w.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for w in alive:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.signal(signal.SIGKILL)
                w.proc.wait(timeout=10)
        for w in self.workers:  # children a worker may have started in its group
            w.signal(signal.SIGKILL)

    def cleanup(self) -> None:
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

