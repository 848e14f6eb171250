"""Two simulated machines on this one: network namespaces with a Spark standalone worker each.

Layout (private addresses used only inside what this module creates):
- a bridge 10.77.0.1/24 in the root namespace, where the Spark master and the driver (the test
  process) listen;
- namespaces hostA (10.77.0.2 on eth0) and hostB (10.77.0.3), each with its own loopback, its own
  hostname (a UTS namespace), its own /etc/hosts with the host's name on 127.0.1.1 (Debian's
  default, which makes Gloo bind loopback unless told otherwise), its own /dev/shm (a tmpfs in a
  mount namespace) and a second interface eth1 (10.78.0.x, a bridge without ports: a management network that
  leads nowhere) for the variant where the hosts' names resolve to it;
- a portless bridge 10.79.0.1/32 in the root namespace: a driver address the hosts have no route to.

No namespace has a default route, so nothing leaves the addresses made here. Everything is torn
down by ``close`` (processes on every host, namespaces, links, /etc/netns entries).
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BRIDGE = "nbdist-br0"
BRIDGE_IP = "10.77.0.1"
UNREACHABLE_IP = "10.79.0.1"  # on a dummy in the root namespace: the hosts have no route to it
DUMMY = "nbdist-dum0"


@dataclass(frozen=True)
class Host:
    name: str  # the hostname inside the namespace
    netns: str
    veth: str  # the root namespace's end of its link
    ip: str  # eth0, on the bridge
    ip2: str  # eth1, the management network that leads nowhere


HOSTS = (Host("hostA", "nbdist-hostA", "nbdist-vA", "10.77.0.2", "10.78.0.2"),
         Host("hostB", "nbdist-hostB", "nbdist-vB", "10.77.0.3", "10.78.0.3"))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def why_not_possible() -> str | None:
    """None when this machine can build the cluster, else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root; run as root to test across simulated hosts"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if _ip("-br", "addr", "show", "to", f"{BRIDGE_IP}/24", check=False).stdout.strip():
        return f"{BRIDGE_IP}/24 is in use already (another run of this test?)"
    probe = "nbdist-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def hosts_file(host: Host, own_ip: str = "127.0.1.1") -> str:
    """/etc/hosts of one host: its own name on ``own_ip``, the others and the driver by their bridge address."""
    lines = ["127.0.0.1 localhost", f"{own_ip} {host.name}"]
    lines += [f"{h.ip} {h.name}" for h in HOSTS if h is not host]
    return "\n".join(lines) + "\n"


class NetnsCluster:
    """A Spark standalone master on the bridge and one worker per simulated host."""

    def __init__(self, workdir: Path, cores_per_host: int = 1) -> None:
        self.workdir = workdir
        self.cores = cores_per_host
        self.procs: list[subprocess.Popen] = []
        self.master_url = ""
        import pyspark

        self.spark_home = Path(pyspark.__file__).parent

    # -- building ------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> NetnsCluster:
        try:
            self._network()
            self._spark(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _network(self) -> None:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        _ip("link", "add", DUMMY, "type", "bridge")  # a bridge with no ports: no dummy module here
        _ip("addr", "add", f"{UNREACHABLE_IP}/32", "dev", DUMMY)
        _ip("link", "set", DUMMY, "up")
        for h in HOSTS:
            _ip("netns", "add", h.netns)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            _ip("link", "set", h.veth, "master", BRIDGE, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "link", "add", "eth1", "type", "bridge")  # no ports: leads nowhere
            _ip("-n", h.netns, "addr", "add", f"{h.ip2}/24", "dev", "eth1")
            _ip("-n", h.netns, "link", "set", "eth1", "up")
            etc = Path("/etc/netns") / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file(h))  # `ip netns exec` bind-mounts it on /etc/hosts

    def set_name_address(self, host: Host, address: str) -> None:
        """Make ``host``'s own name resolve to ``address`` on that host, for processes already running.

        Written in place: the bind mount holds the file's inode, so running hosts see the change.
        """
        with open(Path("/etc/netns") / host.netns / "hosts", "r+") as f:
            f.truncate(0)
            f.write(hosts_file(host, address))

    def run_on(self, host: Host, argv: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
        """Start ``argv`` on ``host``: its network, its hostname, its own /dev/shm."""
        script = ('hostname "$0" && mount -t tmpfs -o size=512m,mode=1777 nbdist-shm /dev/shm && exec "$@"')
        cmd = ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount", "--propagation", "private",
               "sh", "-c", script, host.name, *argv]
        with open(self.workdir / log_name, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def _spark(self, timeout: float) -> None:
        spark_class = str(self.spark_home / "bin" / "spark-class")
        env = dict(os.environ, SPARK_HOME=str(self.spark_home), SPARK_LOCAL_IP=BRIDGE_IP,
                   SPARK_LOG_DIR=str(self.workdir), SPARK_NO_DAEMONIZE="1")
        port = _free_port(BRIDGE_IP)
        with open(self.workdir / "master.log", "wb") as out:
            master = subprocess.Popen(
                [spark_class, "org.apache.spark.deploy.master.Master", "--host", BRIDGE_IP, "--port", str(port),
                 "--webui-port", str(_free_port(BRIDGE_IP))],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(master)
        _wait_for_port(BRIDGE_IP, port, master, timeout)
        self.master_url = f"spark://{BRIDGE_IP}:{port}"
        for h in HOSTS:
            wdir = self.workdir / f"work-{h.name}"
            wdir.mkdir(exist_ok=True)
            henv = dict(env, SPARK_LOCAL_IP=h.ip, SPARK_WORKER_DIR=str(wdir))
            self.run_on(h, [spark_class, "org.apache.spark.deploy.worker.Worker", self.master_url,
                            "--host", h.ip, "--port", "7078", "--webui-port", "8081",
                            "--cores", str(self.cores), "--memory", "2g"], henv, f"worker-{h.name}.log")
        deadline = time.monotonic() + timeout
        master_log = self.workdir / "master.log"
        while master_log.read_text(errors="replace").count("Registering worker") < len(HOSTS):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Spark workers did not register with the master within {timeout:.0f} s")
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Spark daemon exited with {p.returncode}; see {self.workdir}")
            time.sleep(0.5)

    # -- looking inside ------------------------------------------------------
    def pids_on(self, host: Host, needle: str = "") -> list[int]:
        """Processes in ``host``'s network namespace whose command line contains ``needle``."""
        try:
            target = os.stat(f"/run/netns/{host.netns}").st_ino
        except OSError:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino != target:
                    continue
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if needle in cmd and state not in ("Z", "X"):
                found.append(int(entry))
        return found

    @contextlib.contextmanager
    def cut_off(self, host: Host):
        """``host`` cut off from the network (its link to the bridge down) until the block ends: its processes live
        on and its connections stay open, but nothing reaches them and nothing of theirs arrives."""
        _ip("link", "set", host.veth, "down")
        try:
            yield
        finally:
            _ip("link", "set", host.veth, "up", check=False)

    # -- tearing down --------------------------------------------------------
    def close(self) -> None:
        for proc in reversed(self.procs):  # each leads its own process group, executors included
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)
        for h in HOSTS:  # anything that left its group (a worker in its own session) still lives in the netns
            for pid in self.pids_on(h):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            _ip("netns", "del", h.netns, check=False)
            _ip("link", "del", h.veth, check=False)
            shutil.rmtree(Path("/etc/netns") / h.netns, ignore_errors=True)
        with contextlib.suppress(OSError):
            if not any(Path("/etc/netns").iterdir()):
                Path("/etc/netns").rmdir()
        _ip("link", "del", BRIDGE, check=False)
        _ip("link", "del", DUMMY, check=False)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_for_port(host: str, port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Spark daemon exited with {proc.returncode}")
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s")
