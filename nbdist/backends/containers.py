"""Containers backend: N worker containers (Podman or Docker) running the same worker program.

Every container shares the host's network (a worker reaches the notebook's coordinator on loopback, as a
local worker does) and its IPC and PID namespaces (the workers of one machine see one /dev/shm and each
other's processes, so they sum gradients and average weights through shared memory as local workers do; not
PID 1, so no ``--init``, which ``--pid host`` refuses anyway). Each ``<engine> run`` stays attached in a
child process logging to a file: its exit code is the container's, its log the worker's traceback.
Containers are named and labelled after the run, so ``stop()`` finds and removes all of them, with any that
``add_worker`` started after launch (an elastic run's replacement). Without
``--image`` a default image is built once from an empty root file system, with the notebook's interpreter,
virtual environment, nbdist and the host's /usr mounted read-only at the same paths: nothing is pulled.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import TrainConfig, default_local_workers
from ..errors import NbdistError
from ..machine.placement import core_slices, usable_cores
from ..machine.processes import read_log_tail
from ..wire.secret import hand_over
from .command import container_env, job_command, package_root

log = logging.getLogger(__name__)

# Which engines to try, in order; a colon-separated list of names or paths overrides it.
DEFAULT_ENGINES = ("podman", "docker")
LABEL = "nbdist.run"
# What the default image holds; bump when the layout below changes so the image is rebuilt.
BASE_LAYOUT = 1
ENGINE_TIMEOUT = 60.0  # seconds for one engine command (info, import, stop, rm)


@dataclass(frozen=True)
class Engine:
    name: str  # "podman" or "docker": decides the GPU flags
    path: str
    cpuset: bool = False  # containers can be pinned to cores (--cpuset-cpus): the cpuset cgroup is there

    def run(self, args: list[str], timeout: float = ENGINE_TIMEOUT, input: bytes | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.path, *args], input=input, capture_output=True, timeout=timeout)
        if check and proc.returncode != 0:
            err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            raise NbdistError(f"`{self.name} {args[0]}` failed: {err[-1] if err else 'exit ' + str(proc.returncode)}.")
        return proc


def find_engine(candidates: list[str] | None = None) -> Engine:
    """The first container engine that answers ``info``; one sentence naming what was tried if none."""
    if candidates is None:
        candidates = list(DEFAULT_ENGINES)
    tried: list[str] = []
    for cand in candidates:
        path = shutil.which(cand)
        if path is None:
            tried.append(f"{cand} (not found)")
            continue
        name = "docker" if "docker" in Path(cand).name else "podman"
        try:
            proc = subprocess.run([path, "info"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(f"{cand} (`{name} info` did not answer: {exc})")
            continue
        if proc.returncode == 0:
            return Engine(name, path, cpuset_available(name, proc.stdout.decode("utf-8", "replace")
                                                       + proc.stderr.decode("utf-8", "replace")))
        lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        tried.append(f"{cand} (`{name} info` failed: {lines[-1] if lines else 'exit ' + str(proc.returncode)})")
    raise NbdistError(
        f"--backend containers needs Podman or Docker, and neither is usable: tried {'; '.join(tried)}; "
        "install Podman (scripts/install_system_deps.sh does) or start Docker's engine, or use --backend local."
    )


def cpuset_available(name: str, info: str) -> bool:
    """Whether ``<engine> info`` says containers can be given cores: Podman lists ``cpuset`` among its
    cgroup controllers (rootless, only where it was delegated); Docker warns when it has no cpuset."""
    if name != "podman":
        return "No cpuset support" not in info
    lines = info.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "cgroupControllers:"), None)
    if start is None:
        return False
    controllers = []
    for line in lines[start + 1:]:
        if not line.strip().startswith("- "):
            break
        controllers.append(line.strip()[2:].strip())
    return "cpuset" in controllers


# -- the default image ---------------------------------------------------------
def environment_mounts() -> list[str]:
    """Host directories the notebook's Python needs: interpreter, stdlib, venv, nbdist, /usr."""
    paths = {"/usr", sys.prefix, sys.base_prefix, sys.exec_prefix, package_root(),
             str(Path(sys.executable).parent)}
    for entry in sys.path:  # editable installs and .pth additions live outside the prefixes
        if entry and os.path.isdir(entry):
            paths.add(entry)
    resolved = sorted({os.path.realpath(p) for p in paths} | {os.path.abspath(p) for p in paths})
    keep: list[str] = []
    for p in resolved:
        if p in ("/", "/proc", "/sys", "/dev", "/tmp") or p.startswith(("/proc/", "/sys/", "/dev/")):
            continue
        if any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep):
            continue  # already inside a mounted directory
        keep.append(p)
    return keep


def base_image_name() -> str:
    """A name+tag derived from what the image holds (its layout), so it is built once."""
    digest = hashlib.sha256(f"nbdist-base layout {BASE_LAYOUT}".encode()).hexdigest()[:12]
    return f"localhost/nbdist-base:{digest}"


def _base_rootfs() -> bytes:
    """An empty root file system: mount points, /tmp, and the merged-/usr symlinks."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d, mode in (("tmp", 0o1777), ("etc", 0o755), ("proc", 0o555), ("sys", 0o555),
                        ("dev", 0o755), ("usr", 0o755), ("root", 0o700), ("work", 0o755)):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, 0
            tar.addfile(info)
        for link, target in (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"),
                             ("lib64", "usr/lib64")):
            info = tarfile.TarInfo(link)
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, 0
            tar.addfile(info)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"), ("etc/group", "root:x:0:\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def ensure_base_image(engine: Engine) -> str:
    name = base_image_name()
    if engine.run(["image", "inspect", name], check=False).returncode == 0:
        return name
    log.info("building the default worker image %s (once)", name)
    engine.run(["import", "-", name], input=_base_rootfs())
    return name


_checked_images: set[tuple[str, str]] = set()


def check_user_image(engine: Engine, image: str) -> None:
    """Fail with one sentence, before any worker starts, if ``image`` cannot run nbdist's worker."""
    if (engine.path, image) in _checked_images:
        return
    try:
        proc = engine.run(["run", "--rm", "--network", "host", image, "python", "-c", "import nbdist"],
                          timeout=ENGINE_TIMEOUT * 5, check=False)
    except subprocess.TimeoutExpired:
        raise NbdistError(f"--image {image}: `{engine.name} run` did not finish within {ENGINE_TIMEOUT * 5:.0f} s;"
                          " check that the image exists locally or can be pulled.") from None
    if proc.returncode != 0:
        lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        why = lines[-1] if lines else f"exit {proc.returncode}"
        raise NbdistError(f"--image {image} cannot run nbdist's worker ({why}); "
                          "use an image with `python` on its PATH and nbdist installed, or drop --image "
                          "to use the default image.")
    _checked_images.add((engine.path, image))


# -- command lines (pure) ------------------------------------------------------
def gpu_flags(engine_name: str, gpus: str | None) -> list[str]:
    """Docker: ``--gpus``; Podman: CDI devices (needs the NVIDIA CDI spec on the host; unverified here)."""
    if not gpus:
        return []
    if engine_name == "docker":
        return ["--gpus", gpus if gpus == "all" else f'"device={gpus}"']
    if gpus == "all":
        return ["--device", "nvidia.com/gpu=all"]
    return [arg for g in gpus.split(",") for arg in ("--device", f"nvidia.com/gpu={g.strip()}")]


def run_command(engine: Engine, *, name: str, run_id: str, rank: int, image: str, python: str,
                address: tuple[str, int], threads: int, mounts: list[str], config: TrainConfig,
                cores: set[int] | None = None) -> list[str]:
    """``<engine> run ...`` for one worker. The secret is not here: it goes to the worker's stdin
    (``-i``), so neither the command line nor ``<engine> inspect`` shows it."""
    cmd = [engine.path, "run", "--rm", "-i", "--name", name, "--label", f"{LABEL}={run_id}",
           "--label", f"nbdist.rank={rank}", "--network", "host", "--ipc", "host", "--pid", "host",
           "--workdir", "/tmp"]
    for m in mounts:  # the default image: the notebook's own environment, read-only
        cmd += ["--volume", f"{m}:{m}:ro"]
    env = container_env(threads, mounted_package=bool(mounts), gpus=bool(config.container_gpus))
    for k, v in env.items():
        cmd += ["--env", f"{k}={v}"]
    if config.container_cpus:
        cmd += ["--cpus", f"{config.container_cpus:g}"]
    if cores:  # its own cores, as a local worker is pinned to them (placement.core_slices)
        cmd += ["--cpuset-cpus", ",".join(str(c) for c in sorted(cores))]
    if config.container_memory:
        cmd += ["--memory", config.container_memory]
    cmd += gpu_flags(engine.name, config.container_gpus)
    return [*cmd, image, *job_command(address, rank, python=python)]


def _exit_code(code: int | None) -> int | None:
    """Engines report a container killed by signal N as 128+N; the job expects -N."""
    if code is not None and 128 < code < 128 + 65:
        return -(code - 128)
    return code


# -- the backend ---------------------------------------------------------------
class ContainerWorker:
    def __init__(self, rank: int, name: str, proc: subprocess.Popen, log_path: Path) -> None:
        self.rank = rank
        self.name = name
        self.proc = proc
        self.log_path = log_path

    def exit_status(self) -> int | None:
        return _exit_code(self.proc.poll())

    def describe(self) -> str:
        return f"worker {self.rank} (container {self.name})"

    def log_tail(self, lines: int = 20) -> str:
        return read_log_tail(self.log_path, lines)


class ContainerBackend:
    name = "containers"
    bind_host = "127.0.0.1"  # host network: containers share the host's loopback
    advertise_host = "127.0.0.1"
    gloo_ifname: str | None = "lo"
    store_on_link = False
    unreachable_hint = ""  # the coordinator listens on this machine's loopback

    def __init__(self, config: TrainConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.engine = engine or find_engine([config.container_engine] if config.container_engine else None)
        self.run_id = secrets.token_hex(4)
        self.workers: list[ContainerWorker] = []
        self.run_dir: Path | None = None
        self.start_seconds: float | None = None  # seconds launch() took (image check or build, clients spawned)
        # What launch() decided, for a worker added later (add_worker): image, interpreter, mounts, threads, cores.
        self._image, self._python, self._mounts, self._threads = "", "", [], 1
        self._slices: list[set[int]] | None = None

    def default_workers(self) -> int:
        return default_local_workers()

    def container_name(self, rank: int) -> str:
        return f"nbdist-{self.run_id}-w{rank}"

    def launch(self, world_size: int, address: tuple[str, int], secret: bytes,
               threads_per_worker: int, data: Any = None) -> list[ContainerWorker]:
        """``data`` is for the Spark backend; here the data travels in the job messages."""
        t0 = time.monotonic()
        if self.config.image:
            image, python, mounts = self.config.image, "python", []
            check_user_image(self.engine, image)
        else:
            image, python, mounts = ensure_base_image(self.engine), sys.executable, environment_mounts()
        self.run_dir = Path(tempfile.mkdtemp(prefix="nbdist-containers-"))
        cores = usable_cores() if self.engine.cpuset else None
        self._slices = core_slices(cores, world_size, threads_per_worker) if cores else None
        self._image, self._python, self._mounts, self._threads = image, python, mounts, threads_per_worker
        for rank in range(world_size):
            self._start(rank, rank, address, secret)
        log.info("starting %d %s containers (run %s, image %s), logs in %s", world_size, self.engine.name,
                 self.run_id, image, self.run_dir)
        self.start_seconds = time.monotonic() - t0
        return list(self.workers)

    def add_worker(self, rank: int, like: int, address: tuple[str, int], secret: bytes) -> ContainerWorker:
        """One more worker container, ``rank``, after ``launch``, in launch rank ``like``'s place (its cores) with
        the launch's image and thread budget (an elastic run's replacement, driver/training.py)."""
        self._start(rank, like, address, secret)
        log.info("starting container %s in worker %d's place", self.workers[-1].name, like)
        return self.workers[-1]

    def remove_worker(self, rank: int) -> None:
        """End worker ``rank``'s container, which an elastic run went on without (it went silent)."""
        for w in self.workers:
            if w.rank == rank and w.proc.poll() is None:
                self.engine.run(["kill", w.name], check=False)

    def _start(self, rank: int, like: int, address: tuple[str, int], secret: bytes) -> None:
        name = self.container_name(rank)
        cmd = run_command(self.engine, name=name, run_id=self.run_id, rank=rank, image=self._image,
                          python=self._python, address=address, threads=self._threads, mounts=self._mounts,
                          config=self.config, cores=self._slices[like] if self._slices else None)
        log_path = self.run_dir / f"worker-{rank}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # a terminal's Ctrl-C reaches the driver only
        hand_over(proc, secret)
        self.workers.append(ContainerWorker(rank, name, proc, log_path))

    def run_containers(self) -> list[str]:
        """Names of this run's containers that the engine still has (running or not)."""
        proc = self.engine.run(["ps", "-a", "--filter", f"label={LABEL}={self.run_id}",
                                "--format", "{{.Names}}"], check=False)
        return [n for n in proc.stdout.decode().split() if n]

    def partition_rows(self) -> list[int] | None:
        return None  # the data travels in the job messages: nothing for tasks to count

    def stop(self, grace: float = 3.0) -> None:
        alive = [w.name for w in self.workers if w.proc.poll() is None]
        if alive:
            self.engine.run(["stop", "--time", str(max(0, int(grace))), *alive],
                            timeout=grace + ENGINE_TIMEOUT, check=False)
        leftover = self.run_containers()  # also any whose attached client died early
        if leftover:
            self.engine.run(["rm", "-f", *leftover], check=False)
        for w in self.workers:
            try:
                w.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(timeout=10)
        left = self.run_containers()
        if left:
            log.warning("containers still present after stop: %s", ", ".join(left))

    def cleanup(self) -> None:
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

