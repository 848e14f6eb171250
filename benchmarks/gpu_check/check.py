#!/usr/bin/env python3
"""nbdist's first run on a GPU machine: one step per process (check.sh runs each under `timeout`).

    python check.py --step env|torch_gpu|torch_w2|jax_gpu|jax_engine|cpu_scaling|mixed_bf16 --out DIR [--quick]
    python check.py --merge --out DIR        # DIR/steps/*.json -> DIR/results.json

Each step writes DIR/steps/<step>.json after every measurement (a step killed by its timeout
keeps what it had, and names the measurement it was in), and prints one RESULT line each.
The Keras backend is the process's KERAS_BACKEND (check.sh sets it per step).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRATCH = Path(os.environ.get("CHECK_SCRATCH", "/tmp/nbcheck_scratch"))
# Seconds for the workers to start (nbdist's startup_timeout); a stop also waits up to this for its
# event loop. Cold workers on the GPU machine (no warm workers where there are GPUs) take ~10-20 s.
STARTUP_TIMEOUT = float(os.environ.get("CHECK_STARTUP_TIMEOUT", "60"))
STEPS = ("env", "torch_gpu", "jax_gpu", "mixed_bf16", "mixed_bf16_jax", "torch_w2", "jax_engine", "cpu_scaling")


# -- recording ------------------------------------------------------------------
class Recorder:
    def __init__(self, step: str, out: Path, deadline: float) -> None:
        self.step, self.out, self.deadline = step, out, deadline
        self.path = out / "steps" / f"{step}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict = {"step": step, "keras_backend_env": os.environ.get("KERAS_BACKEND"),
                           "started_unix": time.time(), "in_progress": None, "results": {}, "notes": []}
        self.t0 = time.perf_counter()
        self.save()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_jsonable))
        tmp.replace(self.path)

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        print(f"NOTE {self.step}: {text}", flush=True)
        self.save()

    def left(self) -> float:
        """Seconds left before this step's deadline (check.sh kills the step then)."""
        return self.deadline - time.time()

    def run(self, name: str, fn, *args, need_s: float = 5.0, **kwargs) -> dict:
        if self.left() < need_s:
            res = {"ok": False, "skipped": f"step budget: {self.left():.0f} s left, {need_s:.0f} s needed"}
            self.data["results"][name] = res
            self.save()
            print(f"RESULT {self.step}/{name}: SKIPPED ({res['skipped']})", flush=True)
            return res
        self.data["in_progress"] = name
        self.data["in_progress_since_s"] = round(time.perf_counter() - self.t0, 2)
        self.save()
        print(f"--- {self.step}/{name} ({self.left():.0f} s left in step)", flush=True)
        t0 = time.perf_counter()
        try:
            res = fn(*args, **kwargs) or {}
            res.setdefault("ok", True)
        except Exception as exc:
            res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000],
                   "traceback": traceback.format_exc()[-4000:]}
        res["wall_s"] = round(time.perf_counter() - t0, 2)
        self.data["results"][name] = res
        self.data["in_progress"] = None
        self.save()
        summary = res.get("summary") or res.get("error") or res.get("skipped") or ""
        print(f"RESULT {self.step}/{name}: {'ok' if res.get('ok') else 'FAILED'} "
              f"({res['wall_s']:.1f} s) {summary}".rstrip()[:1500], flush=True)
        return res


def _jsonable(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    return repr(o)


def med(xs):
    xs = [float(x) for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def steady(durations):
    """The median of the epochs after the first (the first compiles, warms caches, starts workers)."""
    return med(durations[1:]) if len(durations) > 1 else (med(durations) if durations else None)


def r(x, n=4):
    return None if x is None else round(float(x), n)


# -- GPU sampling (nvidia-smi in the background) --------------------------------------
class GpuSampler:
    """memory.used / utilization.gpu of the whole GPU, and the processes on it, every 250 ms."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.mem: list[float] = []
        self.util: list[float] = []
        self.apps: dict[str, float] = {}
        if shutil.which("nvidia-smi") is None:
            return
        try:
            gpu = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used,utilization.gpu",
                                    "--format=csv,noheader,nounits", "-lms", "250"],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            apps = subprocess.Popen(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                     "--format=csv,noheader,nounits", "-lms", "500"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        self.procs = [gpu, apps]
        threading.Thread(target=self._read_gpu, args=(gpu,), daemon=True).start()
        threading.Thread(target=self._read_apps, args=(apps,), daemon=True).start()

    def _read_gpu(self, p) -> None:
        for line in p.stdout:
            try:
                m, u = (float(v) for v in line.split(",")[:2])
                self.mem.append(m)
                self.util.append(u)
            except ValueError:
                pass

    def _read_apps(self, p) -> None:
        for line in p.stdout:
            parts = [v.strip() for v in line.split(",")]
            if len(parts) >= 2:
                try:
                    self.apps[parts[0]] = max(self.apps.get(parts[0], 0.0), float(parts[1]))
                except ValueError:
                    pass

    def stop(self) -> dict:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                p.kill()
        if not self.procs:
            return {"gpu_sampled": False}
        return {"gpu_max_mem_mib": max(self.mem) if self.mem else None,
                "gpu_util_mean_pct": r(statistics.fmean(self.util), 1) if self.util else None,
                "gpu_util_max_pct": max(self.util) if self.util else None,
                "gpu_samples": len(self.util),
                "gpu_processes_mib": self.apps, "driver_pid": os.getpid()}


# -- nbdist plumbing --------------------------------------------------------------------
CURRENT_LABEL = {"label": None}


def patch_worker_logs(out: Path) -> None:
    """Keep each run's worker logs under OUT/worker_logs/<label>/ (nbdist removes its run folder)."""
    from nbdist.backends import local as nb_local

    original = nb_local.LocalBackend.cleanup
    if getattr(original, "_nbcheck", False):
        return

    def cleanup(self):
        try:
            label = CURRENT_LABEL["label"]
            if label and self.run_dir is not None and Path(self.run_dir).is_dir():
                dest = out / "worker_logs" / label
                dest.mkdir(parents=True, exist_ok=True)
                for f in sorted(Path(self.run_dir).glob("*.log")):
                    data = f.read_bytes()
                    (dest / f.name).write_bytes(data[-200_000:])
        except Exception as exc:  # never let the check's copy break nbdist's cleanup
            print(f"(could not keep worker logs: {exc})", flush=True)
        original(self)

    cleanup._nbcheck = True
    nb_local.LocalBackend.cleanup = cleanup


def log_tails(out: Path, label: str, lines: int = 12) -> dict:
    d = out / "worker_logs" / label
    tails = {}
    for f in sorted(d.glob("*.log")) if d.is_dir() else []:
        text = f.read_text(errors="replace").splitlines()
        keep = [ln for ln in text if ln.strip()]
        tails[f.name] = keep[-lines:]
    return tails


def interesting_log_lines(out: Path, label: str) -> list[str]:
    """Lines of the worker logs worth reading first: engines, NCCL, CUDA, devices, errors, warnings."""
    keys = ("engine", "nccl", "cuda", "gpu", "device", "error", "warning", "xla", "memory", "allocat",
            "traceback", "refus", "duplicate")
    d = out / "worker_logs" / label
    found = []
    for f in sorted(d.glob("*.log")) if d.is_dir() else []:
        for ln in f.read_text(errors="replace").splitlines():
            if any(k in ln.lower() for k in keys):
                found.append(f"{f.stem}: {ln.strip()[:400]}")
    return found[:40]


def weights_of(model):
    import numpy as np

    return [np.asarray(w, dtype=np.float64) for w in model.get_weights()]


def compare(a, b) -> dict:
    """a against b (the reference): largest absolute difference, largest per-tensor relative norm."""
    import numpy as np

    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return {"comparable": False, "why": f"{[x.shape for x in a]} vs {[y.shape for y in b]}"}
    max_abs = max(float(np.max(np.abs(x - y))) if x.size else 0.0 for x, y in zip(a, b))
    rel = max(float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)) for x, y in zip(a, b))
    return {"max_abs_diff": max_abs, "max_rel_norm_diff": rel, "close_1e-5": bool(max_abs <= 1e-5),
            "close_rel_1e-4": bool(rel <= 1e-4)}


def fingerprint(weights) -> list[float]:
    return [round(float(abs(w).sum()), 6) for w in weights]


def device_of(model) -> str:
    import keras

    v = model.weights[0].value
    if keras.backend.backend() == "jax":
        try:
            return ",".join(str(d) for d in v.devices())
        except Exception:
            return str(getattr(v, "device", "?"))
    return str(getattr(v, "device", "?"))


def local_fit(build, x, y, batch, epochs) -> tuple[object, dict]:
    from nbcheck_models import EpochTimer

    model = build()
    init = weights_of(model)
    timer = EpochTimer()
    sampler = GpuSampler()
    t0 = time.perf_counter()
    hist = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[timer])
    wall = time.perf_counter() - t0
    gpu = sampler.stop()
    st = steady(timer.durations)
    info = {"wall_s_fit": r(wall, 3), "epoch_s": [r(d) for d in timer.durations],
            "first_epoch_s": r(timer.durations[0]),
            "steady_epoch_s": r(st), "samples_per_s": r(len(x) / st, 1) if st else None,
            "steps_per_epoch": -(-len(x) // batch), "batch": batch, "epochs": epochs, "rows": len(x),
            "final": {k: r(v[-1], 6) for k, v in hist.history.items()}, "variables_on": device_of(model),
            "init_fingerprint": fingerprint(init)[:2], **gpu}
    info["summary"] = (f"local fit: steady epoch {info['steady_epoch_s']} s ({info['samples_per_s']} samples/s), "
                       f"first {info['first_epoch_s']} s, on_gpu={info['final'].get('on_gpu')}, "
                       f"variables on {info['variables_on']}, loss {info['final'].get('loss')}")
    return model, info


def nbdist_fit(out: Path, label: str, build, x, y, batch_per_worker, epochs, workers, timeout,
               engine=None, rec: Recorder | None = None) -> tuple[object, dict]:
    """nbdist.train(..., strategy="allreduce") in the background, waited for at most ``timeout`` s."""
    import nbdist
    from nbdist.errors import TrainingFailed

    timeout = min(timeout, rec.left() - 4) if rec is not None else timeout
    CURRENT_LABEL["label"] = label
    model = build()
    init = weights_of(model)
    opts = dict(epochs=epochs, batch_size=batch_per_worker, workers=workers, strategy="allreduce", backend="local",
                shuffle=False, lr_scaling="none", startup_timeout=min(STARTUP_TIMEOUT, max(30.0, timeout)),
                heartbeat_timeout=30.0, sync_timeout=60.0)
    if engine is not None:
        opts["engine"] = engine
    sampler = GpuSampler()
    t0 = time.perf_counter()
    info: dict = {"workers": workers, "batch_per_worker": batch_per_worker, "global_batch": batch_per_worker * workers,
                  "epochs": epochs, "rows": len(x), "engine_requested": engine, "timeout_s": r(timeout, 1)}
    job = None
    try:
        job = nbdist.train(model, x, y, background=True, **opts)
        job.wait(timeout=timeout)
        info["outcome"] = "trained"
    except TimeoutError as exc:
        info["outcome"] = "timeout"
        info["error"] = f"no end within {timeout:.0f} s ({exc}); stopped by the check"
        try:
            job.stop("check timeout")
        except Exception as e2:
            info["stop_error"] = repr(e2)
    except TrainingFailed as exc:
        info["outcome"] = "failed"
        info["error"] = str(exc)[:3000]
        info["worker_traceback_tail"] = (exc.worker_traceback or "")[-3000:]
        info["failed_rank"] = exc.rank
    except Exception as exc:
        info["outcome"] = "error"
        info["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        info["traceback"] = traceback.format_exc()[-3000:]
    info["wall_s_train"] = r(time.perf_counter() - t0, 2)
    info.update(sampler.stop())
    if job is not None:
        st = job.state
        if st is not None:
            info["epoch_s"] = [r(s) for s in st.epoch_seconds]
            info["first_metric_after_s"] = r(st.first_metric_at, 2)
            sd = steady(st.epoch_seconds)
            info["steady_epoch_s"] = r(sd)
            info["samples_per_s"] = r(len(x) / sd, 1) if sd else None
            info["status"] = st.status
            info["status_error"] = (st.error or "")[:2000]
        hist = job.history or {}
        info["final"] = {k: r(v[-1], 6) for k, v in hist.items() if v}
        reps = {}
        for rank, rep in sorted((job.reports or {}).items()):
            reps[rank] = {k: rep.get(k) for k in ("engine", "device", "summed_by", "rounds", "sync_seconds",
                                                   "padded_steps",
                                                   "keras_backend", "tensorflow_loaded", "optional_imports")
                          if k in rep}
            if rep.get("rounds"):
                reps[rank]["sync_ms_per_step"] = r(1000 * float(rep.get("sync_seconds") or 0) / rep["rounds"], 3)
        info["reports"] = reps
    info["worker_log_lines"] = interesting_log_lines(out, label)
    if info.get("outcome") != "trained":
        info["worker_log_tails"] = log_tails(out, label)
    info["ok"] = info.get("outcome") == "trained"
    info["init_fingerprint"] = fingerprint(init)[:2]
    eng = {str(v.get("engine")) for v in info.get("reports", {}).values()}
    info["devices"] = [v.get("device") for _, v in sorted(info.get("reports", {}).items())]
    info["summary"] = (f"nbdist w={workers}{' engine=' + engine if engine else ''}: {info.get('outcome')}"
                       f" in {info['wall_s_train']} s; engine={','.join(sorted(eng)) or '-'}; "
                       f"devices={info['devices']}; "
                       f"steady epoch {info.get('steady_epoch_s')} s ({info.get('samples_per_s')} samples/s); "
                       f"on_gpu={info.get('final', {}).get('on_gpu')}; "
                       f"loss {info.get('final', {}).get('loss')}"
                       + (f"; ERROR: {' '.join(info.get('error', '').split())[:600]}" if info.get("error") else ""))
    return model, info


def pair(rec: Recorder, out: Path, tag: str, build, x, y, batch, epochs, nb_timeout) -> dict:
    """A local fit and nbdist with 1 worker on the same model and data; their ratio and weights."""
    model_l, loc = None, None

    def do_local():
        nonlocal model_l, loc
        model_l, loc = local_fit(build, x, y, batch, epochs)
        return loc

    rec.run(f"{tag}_local_fit", do_local, need_s=10)
    res = {}

    def do_nb():
        model_n, info = nbdist_fit(out, f"{rec.step}_{tag}_w1", build, x, y, batch, epochs, 1, nb_timeout, rec=rec)
        if model_l is not None and info.get("ok"):
            info["weights_vs_local"] = compare(weights_of(model_n), weights_of(model_l))
            if loc and loc.get("steady_epoch_s") and info.get("steady_epoch_s"):
                info["steady_ratio_nbdist_over_local"] = r(info["steady_epoch_s"] / loc["steady_epoch_s"], 3)
            info["summary"] += (f"; steady ratio nbdist/local = {info.get('steady_ratio_nbdist_over_local')}"
                                f"; weights vs local: max abs {info['weights_vs_local'].get('max_abs_diff')}, "
                                f"max rel {info['weights_vs_local'].get('max_rel_norm_diff')}")
        res.update(info)
        return info

    rec.run(f"{tag}_nbdist_w1", do_nb, need_s=25)
    return {"local": model_l, "local_info": loc}


# -- sizes ------------------------------------------------------------------------------
def sizes(quick: bool) -> dict:
    if quick:
        return {"digits_epochs": 3, "digits_batch": 64,
                "big_rows": 1024, "big_dim": 64, "big_hidden": [128, 128], "big_batch": 128, "big_epochs": 3,
                "cpu_rows": 2048, "cpu_dim": 64, "cpu_hidden": [128, 128], "cpu_batch": 64, "cpu_epochs": 3,
                "cpu_workers": [1, 2], "nb_timeout": 150, "w2_timeout": 150}
    return {"digits_epochs": 5, "digits_batch": 32,
            "big_rows": 16384, "big_dim": 2048, "big_hidden": [4096, 4096], "big_batch": 512, "big_epochs": 4,
            "cpu_rows": 16384, "cpu_dim": 256, "cpu_hidden": [1024, 1024], "cpu_batch": 64, "cpu_epochs": 3,
            "cpu_workers": [1, 2, 4, 8], "nb_timeout": 90, "w2_timeout": 45}


# -- steps ------------------------------------------------------------------------------
def run_cmd(cmd, timeout, env=None) -> dict:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return {"rc": p.returncode, "stdout": p.stdout[-6000:], "stderr": p.stderr[-6000:]}
    except subprocess.TimeoutExpired as exc:
        return {"rc": None, "error": f"timeout after {timeout} s", "stdout": str(exc.stdout or "")[-3000:]}
    except OSError as exc:
        return {"rc": None, "error": repr(exc)}


IMPORT_PROBE = r"""
import importlib.util, json, os, sys, time
t0 = time.perf_counter()
res = {"KERAS_BACKEND": os.environ.get("KERAS_BACKEND")}
try:
    import nbdist, nbdist.api, nbdist.worker.allreduce_fit, nbdist.strategies.backend_grads
    res["nbdist_file"] = nbdist.__file__
    import keras
    res["keras"] = keras.__version__
    res["keras_backend"] = keras.backend.backend()
    x = keras.ops.ones((2, 2)) * 2
    if res["keras_backend"] == "torch":
        import torch
        res["tensor_device"] = str(x.device)
        res["torch"] = torch.__version__
        res["torch_cuda_available"] = torch.cuda.is_available()
    elif res["keras_backend"] == "jax":
        import jax
        res["jax"] = jax.__version__
        res["jax_devices"] = [str(d) for d in jax.devices()]
        res["jax_default_backend"] = jax.default_backend()
        res["tensor_device"] = ",".join(str(d) for d in x.devices())
    res["ok"] = True
except Exception as exc:
    import traceback
    res["ok"] = False
    res["error"] = f"{type(exc).__name__}: {exc}"
    res["traceback"] = traceback.format_exc()[-3000:]
res["tensorflow_loaded"] = "tensorflow" in sys.modules
res["tensorflow_installed"] = importlib.util.find_spec("tensorflow") is not None
res["ipython_installed"] = importlib.util.find_spec("IPython") is not None
res["import_s"] = round(time.perf_counter() - t0, 2)
print("PROBE " + json.dumps(res))
"""


def run_probe(code: str, timeout: float, env=None) -> dict:
    """Run ``code`` in a fresh Python and read the JSON of its ``PROBE`` line (its stderr's tail beside it); a
    probe that printed none gives ok False, the error and the stderr's tail as its summary."""
    res = run_cmd([sys.executable, "-c", code], timeout, env=env)
    line = next((ln for ln in res.get("stdout", "").splitlines() if ln.startswith("PROBE ")), None)
    if line is None:
        why = res.get("error") or f"rc {res.get('rc')}: {res.get('stderr', '')[-2000:]}"
        return {"ok": False, "error": why, "summary": f"probe printed nothing: {why}"[:700]}
    out = json.loads(line[6:])
    out["stderr_tail"] = res.get("stderr", "")[-1500:]
    return out


def step_env(rec: Recorder, args) -> None:
    def smi():
        if shutil.which("nvidia-smi") is None:
            return {"ok": True, "gpu": False, "summary": "no nvidia-smi on PATH: no NVIDIA driver, no GPU"}
        res = run_cmd(["nvidia-smi", "-L"], 20)
        q = run_cmd(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,compute_cap",
                     "--format=csv,noheader"], 20)
        res["query"] = q.get("stdout", "").strip() or q.get("error")
        res["summary"] = (res.get("stdout", "").strip() or res.get("error", "")).replace("\n", " | ")
        res["ok"] = res.get("rc") == 0
        return res

    rec.run("nvidia_smi", smi)

    def host():
        import importlib.metadata as md

        info = {"python": sys.version, "executable": sys.executable, "cpu_count": os.cpu_count(),
                "affinity": len(os.sched_getaffinity(0)), "PYTHONPATH": os.environ.get("PYTHONPATH")}
        for pkg in ("numpy", "keras", "torch", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt",
                    "optree", "namex", "ml-dtypes", "h5py", "cloudpickle", "psutil", "scikit-learn", "tensorflow",
                    "ipython", "packaging", "typing_extensions", "nvidia-nccl-cu13", "nvidia-nccl-cu12"):
            try:
                info[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                info[pkg] = None
        try:
            import torch

            info["torch_cuda_available"] = torch.cuda.is_available()
            info["torch_cuda_version"] = torch.version.cuda
            info["torch_device_count"] = torch.cuda.device_count()
            if torch.cuda.is_available():
                info["torch_device_name"] = torch.cuda.get_device_name(0)
                try:
                    info["nccl_version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
                except Exception as exc:
                    info["nccl_version"] = repr(exc)
            info["torch_nccl_available"] = torch.distributed.is_nccl_available()
            info["torch_threads"] = torch.get_num_threads()
        except Exception as exc:
            info["torch_error"] = repr(exc)
        info["summary"] = (f"python {sys.version.split()[0]}, numpy {info['numpy']}, keras {info['keras']}, "
                           f"torch {info['torch']} (cuda {info.get('torch_cuda_version')}, available "
                           f"{info.get('torch_cuda_available')}, nccl {info.get('nccl_version')}), jax {info['jax']}, "
                           f"tensorflow {info['tensorflow']}, ipython {info['ipython']}, cpus {info['affinity']}")
        return info

    rec.run("host", host)

    for backend in ("torch", "jax"):
        def probe(backend=backend):
            out = run_probe(IMPORT_PROBE, 40, env={**os.environ, "KERAS_BACKEND": backend})
            if "summary" in out:  # it never printed its line
                return out
            out["summary"] = (f"nbdist imports: {out.get('ok')} (from {out.get('nbdist_file')}); "
                              f"keras {out.get('keras')} on {out.get('keras_backend')}, "
                              f"tensor on {out.get('tensor_device')}, tensorflow installed "
                              f"{out.get('tensorflow_installed')} loaded {out.get('tensorflow_loaded')}, "
                              f"jax devices {out.get('jax_devices')}, torch cuda {out.get('torch_cuda_available')}"
                              + (f"; ERROR {out.get('error')}" if out.get("error") else ""))
            return out

        rec.run(f"import_{backend}", probe, need_s=15)

    def placement():
        from nbdist.machine import placement as pl
        from nbdist.machine.engines import Facts, gpu_facts, select

        def engine(backend, gpus):
            kind, obstacle = gpu_facts(gpus)
            plan = select(Facts(backend, gpus=kind, obstacle=obstacle, bucket_bytes=100 * 2**20))
            return f"{plan.engine_name}/{plan.summed_by}", plan.notice

        count = pl.count_host_gpus()
        res = {"count_host_gpus": count,
               "parent_CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "per_rank": {rk: pl.local_gpu_env(rk) for rk in range(4)},
               "per_rank_parent_hidden": {rk: pl.local_gpu_env(rk, environ={"CUDA_VISIBLE_DEVICES": ""})
                                          for rk in range(2)},
               "torch_engine_2_ranks_own_gpus": engine("torch", ["h/0", "h/1"])[0],
               "torch_engine_2_ranks_one_gpu": engine("torch", ["h/0", "h/0"]),
               "jax_engine_2_ranks_own_gpus": engine("jax", ["h/0", "h/1"])[0],
               "jax_engine_2_ranks_one_gpu": engine("jax", ["h/0", "h/0"]),
               "default_workers": pl.default_worker_count(
                   pl.visible_gpu_count(count, os.environ.get("CUDA_VISIBLE_DEVICES")), 2),
               "jax_env_2_workers": pl.local_gpu_env(1, gpu_count=count, world=2),
               "threads_per_worker": {w: pl.threads_per_worker(w) for w in (1, 2, 4, 8, 16)}}
        res["summary"] = (f"host GPUs {count}; CUDA_VISIBLE_DEVICES per rank 0..3: "
                          f"{[v['CUDA_VISIBLE_DEVICES'] for v in res['per_rank'].values()]}; "
                          "parent '' -> "
                          f"{[v['CUDA_VISIBLE_DEVICES'] for v in res['per_rank_parent_hidden'].values()]}; "
                          f"engine for 2 ranks on 2 GPUs: {res['torch_engine_2_ranks_own_gpus']}, on 1: "
                          f"{res['torch_engine_2_ranks_one_gpu'][0]} (JAX: {res['jax_engine_2_ranks_own_gpus']}, "
                          f"{res['jax_engine_2_ranks_one_gpu'][0]}); default workers {res['default_workers'][0]}")
        return res

    rec.run("placement", placement)

    def magics():
        try:
            import nbdist.magics  # noqa: F401

            return {"summary": "nbdist.magics imports (IPython present)"}
        except Exception as exc:
            return {"ok": True, "magics_import_error": f"{type(exc).__name__}: {exc}",
                    "summary": "nbdist.magics does not import here (expected without IPython): "
                               f"{type(exc).__name__}: {exc}"}

    rec.run("magics_import", magics)


def has_gpu() -> bool:
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return jax.default_backend() == "gpu"
    import torch

    return torch.cuda.is_available()


def gpu_precheck(rec: Recorder, args) -> bool:
    if has_gpu():
        return True
    if args.force_cpu:
        rec.note("no GPU: running the GPU step on the CPU (--force-cpu), to exercise the code path only")
        return True
    rec.note("no GPU: the Keras backend sees none; GPU measurements skipped")
    rec.data["no_gpu"] = True
    rec.save()
    print(f"RESULT {rec.step}: no GPU (skipped)", flush=True)
    return False


def step_gpu_pair(rec: Recorder, args) -> None:
    """torch_gpu / jax_gpu: digits and the big MLP, local fit vs nbdist 1 worker (and, on JAX, 2 workers)."""
    import keras
    import numpy as np
    from nbcheck_models import digits, generated, mlp

    rec.data["backend"] = keras.backend.backend()
    if not gpu_precheck(rec, args):
        return
    if keras.backend.backend() == "jax":
        import jax

        rec.data["jax_devices"] = [str(d) for d in jax.devices()]
        rec.data["XLA_PYTHON_CLIENT_PREALLOCATE"] = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")
    s = sizes(args.quick)
    xd, yd = digits()
    pair(rec, args.out, "digits", lambda: mlp(64, [64], lr=1e-3, seed=1), xd, yd, s["digits_batch"],
         s["digits_epochs"], s["nb_timeout"])
    if keras.backend.backend() == "torch":
        cpu_workers_beside_gpu_driver(rec, args, xd, yd, s)
    xb, yb = generated(s["big_rows"], s["big_dim"])
    build_big = lambda: mlp(s["big_dim"], s["big_hidden"], lr=1e-4, seed=2)
    params = build_big().count_params()
    rec.data["big_model_params"] = params
    got = pair(rec, args.out, "big", build_big, xb, yb, s["big_batch"], s["big_epochs"], s["nb_timeout"])
    per_step_read_cost(rec, build_big, xb, yb, s, got["local_info"])
    if got["local"] is not None and keras.backend.backend() == "torch":
        SCRATCH.mkdir(parents=True, exist_ok=True)
        tag = f"{s['big_rows']}x{s['big_dim']}"
        np.savez(SCRATCH / f"big_local_torch_{tag}.npz", *[w.astype(np.float32) for w in weights_of(got["local"])])
        (SCRATCH / f"big_local_torch_{tag}.json").write_text(json.dumps(got["local_info"], default=_jsonable))
    if keras.backend.backend() == "jax":
        # --engine jax: with a GPU each (2+ GPUs), JAX's own collectives (NCCL in XLA) inside the step; two
        # workers on one GPU: its one sentence, and Gloo (NCCL refuses two ranks on one device).
        two_workers(rec, args, build_big, xb, yb, s, got["local"], got["local_info"], engines=(None, "jax"))
        retry_without_preallocation(rec, args, build_big, xb, yb, s, got["local"], got["local_info"])


def per_step_read_cost(rec: Recorder, build, x, y, s, local_info) -> None:
    """Plain fit with one batch-end callback that is not ``async_safe``, against plain fit without: Keras then
    reads every step's logs as Python floats, which waits for the GPU each step. nbdist's workers of a run of
    several have such callbacks (the pad steps and the metrics' sum at the end of a pass), so this is what
    that wait costs a run on N GPUs; one worker has none."""
    import keras

    class ReadsLogs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    def do():
        from nbcheck_models import EpochTimer

        model, timer = build(), EpochTimer()
        model.fit(x, y, batch_size=s["big_batch"], epochs=s["big_epochs"], shuffle=False, verbose=0,
                  callbacks=[timer, ReadsLogs()])
        st = steady(timer.durations)
        base = (local_info or {}).get("steady_epoch_s")
        info = {"steady_epoch_s": r(st), "plain_steady_epoch_s": base,
                "ratio_over_plain": r(st / base, 3) if st and base else None}
        info["summary"] = (f"plain fit with a per-step log read: steady epoch {info['steady_epoch_s']} s, "
                           f"x{info['ratio_over_plain']} plain fit")
        return info

    rec.run("big_local_fit_reading_logs_every_step", do, need_s=15)


def cpu_workers_beside_gpu_driver(rec: Recorder, args, x, y, s) -> None:
    """The notebook's model on the GPU, its worker with CUDA hidden (CUDA_VISIBLE_DEVICES="" in the
    environment the workers inherit; as a container without --gpus or a CPU Spark executor would be):
    the pickled model carries the layers' torch parameters (Keras' torch layers keep them in a
    ParameterDict), so a CUDA tensor has to be unpickled where there is no CUDA."""
    from nbcheck_models import mlp

    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        def do():
            _, info = nbdist_fit(args.out, f"{rec.step}_digits_w1_cpu_workers", lambda: mlp(64, [64], lr=1e-3, seed=1),
                                 x, y, s["digits_batch"], 2, 1, s["w2_timeout"], rec=rec)
            return info

        rec.run("digits_nbdist_w1_cpu_workers_gpu_driver", do, need_s=25)
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def two_workers(rec: Recorder, args, build, x, y, s, local_model, local_info, engines=(None,), prefix="big") -> None:
    """2 workers on one GPU, per-worker batch half the local fit's: the same global batch and steps."""
    half = s["big_batch"] // 2
    for engine in engines:
        name = f"{prefix}_nbdist_w2" + (f"_{engine}" if engine else "_default_engine")

        def do(engine=engine, name=name):
            model, info = nbdist_fit(args.out, f"{rec.step}_{name}", build, x, y, half, s["big_epochs"], 2,
                                     s["w2_timeout"], engine=engine, rec=rec)
            if info.get("ok") and local_model is not None:
                info["weights_vs_local_global_batch"] = compare(weights_of(model), weights_of(local_model))
                if local_info and local_info.get("steady_epoch_s") and info.get("steady_epoch_s"):
                    info["steady_ratio_nbdist_over_local"] = r(info["steady_epoch_s"] / local_info["steady_epoch_s"], 3)
                info["summary"] += (f"; steady ratio w2/local = {info.get('steady_ratio_nbdist_over_local')}; "
                                    f"weights vs local (same global batch): max rel "
                                    f"{info['weights_vs_local_global_batch'].get('max_rel_norm_diff')}")
            return info

        rec.run(name, do, need_s=25)


def retry_without_preallocation(rec: Recorder, args, build, x, y, s, local_model, local_info) -> None:
    """JAX preallocates 75% of the GPU per process: if a worker run failed beside this process's JAX,
    try once more with XLA_PYTHON_CLIENT_PREALLOCATE=false in the workers' environment."""
    failed = [k for k, v in rec.data["results"].items() if "nbdist" in k and not v.get("ok") and not v.get("skipped")]
    rec.data["failed_with_default_allocator"] = failed
    if not failed or os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"):
        return
    rec.note(f"retrying with XLA_PYTHON_CLIENT_PREALLOCATE=false for the workers after {failed} failed")
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    try:
        def do():
            model, info = nbdist_fit(args.out, f"{rec.step}_big_w1_noprealloc", build, x, y, s["big_batch"],
                                     s["big_epochs"], 1, s["nb_timeout"], rec=rec)
            if info.get("ok") and local_model is not None:
                info["weights_vs_local"] = compare(weights_of(model), weights_of(local_model))
                if local_info and local_info.get("steady_epoch_s") and info.get("steady_epoch_s"):
                    info["steady_ratio_nbdist_over_local"] = r(info["steady_epoch_s"] / local_info["steady_epoch_s"], 3)
            return info

        rec.run("big_nbdist_w1_workers_noprealloc", do, need_s=25)
        two_workers(rec, args, build, x, y, s, local_model, local_info, prefix="big_noprealloc")
    finally:
        os.environ.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)


NCCL_SUM_PROBE = r"""
import json, os, sys, time
import numpy as np
import torch
import torch.distributed as dist
from nbdist.strategies.backend_grads import HostGradientAllreduce
from nbdist.strategies.device_sum import TorchDeviceSum
from nbdist.strategies.collective import SoloCollective
res = {}
device, backend = ("cuda", "nccl") if torch.cuda.is_available() else ("cpu", "gloo")
res["device"], res["backend"] = device, backend
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    shapes = [(2048, 4096), (4096,), (4096, 4096), (4096,), (4096, 10), (10,)]
    owner = HostGradientAllreduce(SoloCollective(), [np.zeros(s, np.float32) for s in shapes])
    t0 = time.perf_counter()
    if device == "cuda":
        torch.cuda.set_device(0)
    nccl = TorchDeviceSum(shapes, device, dist.new_group(backend=backend), check_every=1)
    res["group_s"] = round(time.perf_counter() - t0, 3)
    g = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, device=device, generator=g) for s in shapes]
    grads[1] = None
    times = []
    for i in range(6):
        owner.set_weight(512, 512)
        owner._take_weight()
        t0 = time.perf_counter()
        out = nccl.reduce(owner, grads)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    res["first_reduce_s"] = round(times[0], 4)
    res["steady_reduce_ms"] = round(1000 * sorted(times[1:])[len(times[1:]) // 2], 3)
    res["same_values"] = all(o is None if x is None else bool(torch.equal(o, x)) for o, x in zip(out, grads))
    res["out_devices"] = sorted({str(o.device) for o in out if o is not None})
    res["none_kept"] = out[1] is None
    owner.set_weight(256, 512)
    owner._take_weight()
    try:
        nccl.reduce(owner, grads)
        res["disagreeing_total"] = "not refused"
    except RuntimeError as exc:
        res["disagreeing_total"] = f"refused: {exc}"
    z = nccl.zeros(shapes, [True, False, True, True, True, True])
    res["pad_zeros_ok"] = z[1] is None and all(float(t.abs().sum()) == 0 for t in z if t is not None)
    # The averaging strategy's round on the same group (TorchDeviceAverage): one rank, so each variable's
    # average is itself, and the total is this rank's samples.
    from nbdist.strategies.device_sum import TorchDeviceAverage

    class Var:
        def __init__(self, value):
            self.value, self.shape = value, tuple(value.shape)

    variables = [Var(torch.randn(s, device=device, generator=g)) for s in shapes]
    before = [v.value.clone() for v in variables]
    averager = TorchDeviceAverage(variables, device, dist.new_group(backend=backend))
    rounds = []
    for i in range(4):
        t0 = time.perf_counter()
        total = averager.average(512)
        rounds.append(time.perf_counter() - t0)
    res["average_total"] = total
    res["average_round_ms"] = round(1000 * sorted(rounds[1:])[len(rounds[1:]) // 2], 3)
    res["average_same_values"] = all(bool(torch.allclose(v.value, b, rtol=1e-6, atol=0))
                                     for v, b in zip(variables, before))
    res["ok"] = bool(res["same_values"] and res["none_kept"] and res["pad_zeros_ok"] and total == 512
                     and res["average_same_values"])
except Exception as exc:
    import traceback
    res["ok"] = False
    res["error"] = f"{type(exc).__name__}: {exc}"
    res["traceback"] = traceback.format_exc()[-3000:]
print("PROBE " + json.dumps(res))
sys.stdout.flush()
os._exit(0)
"""


def nccl_sum_one_rank(rec: Recorder) -> None:
    """nbdist's TorchDeviceSum and TorchDeviceAverage on a one-rank NCCL group (the only NCCL group one GPU
    allows): their code around the collective on the real device and backend, which the tests run with the CPU
    and Gloo standing in."""
    def do():
        out = run_probe(NCCL_SUM_PROBE, min(45, max(5, rec.left() - 3)))
        if "summary" in out:
            return out
        out["summary"] = (f"TorchDeviceSum on 1 rank, {out.get('backend')} on {out.get('device')}: values back "
                          f"{out.get('same_values')}, on {out.get('out_devices')}, None kept {out.get('none_kept')}, "
                          f"pad zeros {out.get('pad_zeros_ok')}, "
                          f"25M floats summed in {out.get('steady_reduce_ms')} ms, "
                          f"{out.get('disagreeing_total')}; TorchDeviceAverage: total {out.get('average_total')}, "
                          f"values kept {out.get('average_same_values')}, a round {out.get('average_round_ms')} ms"
                          + (f"; ERROR {out.get('error')}" if out.get("error") else ""))
        return out

    rec.run("torch_nccl_sum_1rank", do, need_s=10)


def step_torch_w2(rec: Recorder, args) -> None:
    """2 workers sharing the one GPU on torch: the default engine (NCCL when both see a GPU), then Gloo."""
    import numpy as np
    from nbcheck_models import generated, mlp

    if not gpu_precheck(rec, args):
        return
    s = sizes(args.quick)
    xb, yb = generated(s["big_rows"], s["big_dim"])
    build_big = lambda: mlp(s["big_dim"], s["big_hidden"], lr=1e-4, seed=2)
    local_model, local_info = None, None
    tag = f"{s['big_rows']}x{s['big_dim']}"
    saved = SCRATCH / f"big_local_torch_{tag}.npz"
    if saved.exists():
        z = np.load(saved)

        class Saved:  # the torch_gpu step's local fit of the same model and data
            def get_weights(self):
                return [z[f"arr_{i}"] for i in range(len(z.files))]

        local_model = Saved()
        try:
            local_info = json.loads((SCRATCH / f"big_local_torch_{tag}.json").read_text())
        except (OSError, ValueError):
            local_info = None
    else:
        rec.note("no saved local fit from torch_gpu: weights and ratios not compared")
    nccl_sum_one_rank(rec)  # first: cheap, and independent of what two workers on one GPU do
    two_workers(rec, args, build_big, xb, yb, s, local_model, local_info, engines=(None, "gloo"))
    sgd_on_two_workers(rec, args, xb, yb, s)


def sgd_on_two_workers(rec: Recorder, args, x, y, s) -> None:
    """The first GPU run's 2 workers ended 0.086 (largest relative difference) from the local fit with Adam.
    benchmarks/summation_order.py reproduced it on the CPU from the order of summation alone (0.049 after 4
    epochs with Adam, 1.6e-3 with SGD, both in a bias whose norm is tiny; docs/gpus.md). With SGD, whose
    update is proportional to its gradient, the GPU's figure should fall to rounding size too."""
    from nbcheck_models import mlp

    build = lambda: mlp(s["big_dim"], s["big_hidden"], lr=0.01, seed=2, optimizer="sgd")
    got: dict = {}

    def local():
        got["model"], info = local_fit(build, x, y, s["big_batch"], s["big_epochs"])
        return info

    rec.run("big_sgd_local_fit", local, need_s=10)
    if "model" in got:
        two_workers(rec, args, build, x, y, s, got["model"], None, engines=("gloo",), prefix="big_sgd")


class _OneRankStore:
    """The workers' rendezvous store as ``join_jax_job`` uses it (``set``, ``get``), for a job of one process."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]


class _OneRank:
    rank, world_size = 0, 1

    def __init__(self) -> None:
        self.store = _OneRankStore()


def step_jax_engine(rec: Recorder, args) -> None:
    """JAX's device sum (the default on JAX where every worker has a GPU of its own) on the one GPU: this
    process joins a one-process ``jax.distributed`` job as a worker does (model state read out, backend
    restarted, state put back), Keras' step runs in ``shard_map`` with the psum, against plain fit of the
    same model on the same GPU: the code path a run on N GPUs takes, with NCCL's part left to XLA."""
    import keras
    from nbcheck_models import EpochTimer, generated, mlp

    from nbdist.strategies.jax_device_sum import JaxDeviceSum, join_jax_job

    rec.data["backend"] = keras.backend.backend()
    if not gpu_precheck(rec, args):
        return
    s = sizes(args.quick)
    x, y = generated(s["big_rows"], s["big_dim"])
    build = lambda: mlp(s["big_dim"], s["big_hidden"], lr=1e-4, seed=2)
    got: dict = {}

    def plain():
        model, info = local_fit(build, x, y, s["big_batch"], s["big_epochs"])
        got["weights"], got["info"] = weights_of(model), info
        return info

    rec.run("big_plain_fit", plain, need_s=20)

    def against_plain(model, timer) -> dict:
        """Epoch times, devices, and the weights and steady epoch against the plain fit's."""
        import jax

        st = steady(timer.durations)
        info = {"epoch_s": [r(d) for d in timer.durations], "steady_epoch_s": r(st),
                "devices": [str(d) for d in jax.devices()], "variables_on": device_of(model)}
        if got.get("weights") is not None:
            info["weights_vs_plain"] = compare(weights_of(model), got["weights"])
            base = got["info"].get("steady_epoch_s")
            info["steady_ratio_over_plain"] = r(st / base, 3) if st and base else None
        return info

    def engine():
        import jax

        model = build()
        t0 = time.perf_counter()
        join_jax_job(model, _OneRank(), "127.0.0.1", 60.0, jax.default_backend() == "gpu")
        joined = time.perf_counter() - t0
        summer = JaxDeviceSum(model)
        summer.install()
        timer = EpochTimer()
        model.fit(x, y, batch_size=s["big_batch"], epochs=s["big_epochs"], shuffle=False, verbose=0,
                  callbacks=[timer])
        info = {"join_s": r(joined, 3), "steps_in_mesh": summer.steps, **against_plain(model, timer)}
        info["summary"] = (f"jax engine, one process on {info['devices']}: join {info['join_s']} s, steady epoch "
                           f"{info['steady_epoch_s']} s (x{info.get('steady_ratio_over_plain')} plain fit), "
                           f"{summer.steps} steps in the mesh, weights vs plain max abs "
                           f"{info.get('weights_vs_plain', {}).get('max_abs_diff')}")
        return info

    rec.run("big_jax_engine_one_process", engine, need_s=20)

    def average():
        """The averaging strategy's rounds in the same job (``JaxDeviceAverage``), every step: the worker's own
        callback and callback list, so Keras reads no log on the training thread; one process, so each round's
        average is the weights themselves, and the weights must equal plain fit's."""
        from nbdist.model.spec import averaged_optimizer_variables, build_optimizer
        from nbdist.strategies.averaging import rounds_in_epoch
        from nbdist.strategies.jax_device_sum import JaxDeviceAverage
        from nbdist.worker.callback_list import WorkerCallbacks
        from nbdist.worker.callbacks import AveragingCallback

        model = build()
        build_optimizer(model)
        averager = JaxDeviceAverage(model, [w for w in model.weights if "float" in str(w.dtype)]
                                    + averaged_optimizer_variables(model))
        steps = -(-len(x) // s["big_batch"])
        timer = EpochTimer()
        rounds = AveragingCallback(averager, 1, len(x), s["big_batch"], rounds_in_epoch(steps, 1))
        listed = WorkerCallbacks([rounds, timer], model, s["big_epochs"], steps)
        model.fit(x, y, batch_size=s["big_batch"], epochs=s["big_epochs"], shuffle=False, verbose=0,
                  callbacks=listed)
        info = {"rounds": averager.rounds, **against_plain(model, timer)}
        info["summary"] = (f"jax device averaging every step, one process: steady epoch {info['steady_epoch_s']} s "
                           f"(x{info.get('steady_ratio_over_plain')} plain fit), {averager.rounds} rounds, weights "
                           f"vs plain max abs {info.get('weights_vs_plain', {}).get('max_abs_diff')}")
        return info

    rec.run("big_jax_device_average_one_process", average, need_s=20)


def step_cpu_scaling(rec: Recorder, args) -> None:
    """torch on CPU only (CUDA hidden from this process and so from its workers): throughput vs workers."""
    import keras
    import torch
    from nbcheck_models import generated, mlp

    rec.data["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    rec.data["torch_cuda_available"] = torch.cuda.is_available()
    rec.data["backend"] = keras.backend.backend()
    cores = len(os.sched_getaffinity(0))
    rec.data["cores"] = cores
    s = sizes(args.quick)
    x, y = generated(s["cpu_rows"], s["cpu_dim"], seed=3)
    build = lambda: mlp(s["cpu_dim"], s["cpu_hidden"], lr=1e-3, seed=4)
    rec.data["model_params"] = build().count_params()
    base = {}

    def plain():
        torch.set_num_threads(cores)
        _, info = local_fit(build, x, y, s["cpu_batch"], s["cpu_epochs"])
        info["torch_threads"] = torch.get_num_threads()
        base.update(info)
        return info

    rec.run("plain_fit", plain, need_s=10)
    torch.set_num_threads(1)  # the driver does not compete with its workers for the cores
    for w in s["cpu_workers"]:
        def do(w=w):
            _, info = nbdist_fit(args.out, f"cpu_w{w}", build, x, y, s["cpu_batch"], s["cpu_epochs"], w,
                                 s["nb_timeout"], rec=rec)
            if info.get("samples_per_s") and base.get("samples_per_s"):
                info["throughput_over_plain"] = r(info["samples_per_s"] / base["samples_per_s"], 3)
            w1 = rec.data["results"].get("nbdist_w1", {}).get("samples_per_s")
            if info.get("samples_per_s") and w1:
                info["throughput_over_w1"] = r(info["samples_per_s"] / w1, 3)
            info["summary"] += (f"; throughput x{info.get('throughput_over_plain')} plain fit, "
                                f"x{info.get('throughput_over_w1')} 1 worker")
            return info

        rec.run(f"nbdist_w{w}", do, need_s=20)
    table = {k: {"samples_per_s": v.get("samples_per_s"), "over_plain": v.get("throughput_over_plain"),
                 "over_w1": v.get("throughput_over_w1")} for k, v in rec.data["results"].items()}
    rec.data["table"] = table
    rec.save()
    print(f"RESULT cpu_scaling/table: {json.dumps(table)}", flush=True)


def step_mixed_bf16(rec: Recorder, args) -> None:
    import keras
    from nbcheck_models import digits, generated, mlp

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    rec.data["policy"] = str(keras.mixed_precision.global_policy().name)
    if not gpu_precheck(rec, args):
        return
    s = sizes(args.quick)
    xd, yd = digits()
    pair(rec, args.out, "digits", lambda: mlp(64, [64], lr=1e-3, seed=1), xd, yd, s["digits_batch"],
         min(3, s["digits_epochs"]), s["nb_timeout"])
    if not args.quick:
        xb, yb = generated(s["big_rows"] // 2, s["big_dim"])
        pair(rec, args.out, "big", lambda: mlp(s["big_dim"], s["big_hidden"], lr=1e-4, seed=2), xb, yb,
             s["big_batch"], 3, s["nb_timeout"])


# -- merge ------------------------------------------------------------------------------------
def merge(out: Path) -> None:
    steps = {}
    for f in sorted((out / "steps").glob("*.json")):
        try:
            steps[f.stem] = json.loads(f.read_text())
        except ValueError as exc:
            steps[f.stem] = {"unreadable": repr(exc)}
    meta = {}
    for f in (out / "meta.json",):
        if f.exists():
            try:
                meta = json.loads(f.read_text())
            except ValueError:
                pass
    lines = []
    for name in STEPS:
        st = steps.get(name)
        if st is None:
            lines.append(f"{name}: not run")
            continue
        if st.get("skipped"):
            lines.append(f"{name}: SKIPPED ({st['skipped']})")
        if st.get("in_progress"):
            lines.append(f"{name}: KILLED during {st['in_progress']} (after {st.get('elapsed_s')} s)")
        if st.get("step_error"):
            lines.append(f"{name}: STEP FAILED {st['step_error']}")
        for k, v in st.get("results", {}).items():
            state = "ok" if v.get("ok") else "SKIPPED" if v.get("skipped") else "FAILED"
            lines.append(f"{name}/{k}: {state} "
                         f"{v.get('summary') or v.get('error') or v.get('skipped') or ''}"[:700])
        for n in st.get("notes", []):
            lines.append(f"{name}: note: {n}")
    doc = {"meta": meta, "summary": lines, "steps": steps}
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=_jsonable))
    tmp.replace(out / "results.json")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--step", choices=STEPS)
    p.add_argument("--merge", action="store_true")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/out"))
    p.add_argument("--quick", action="store_true", help="small sizes (a 2-core CPU machine)")
    p.add_argument("--force-cpu", action="store_true", help="run the GPU steps on the CPU (to test this script)")
    p.add_argument("--deadline", type=float, default=0.0, help="unix time the step is killed at (check.sh)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merge(args.out)
        return 0
    sys.path.insert(0, str(HERE))
    deadline = args.deadline or time.time() + 600
    rec = Recorder(args.step, args.out, deadline)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("jax", "absl", "urllib3", "h5py"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.step != "env":
            patch_worker_logs(args.out)
        {"env": step_env, "torch_gpu": step_gpu_pair, "jax_gpu": step_gpu_pair, "torch_w2": step_torch_w2,
         "jax_engine": step_jax_engine, "cpu_scaling": step_cpu_scaling, "mixed_bf16": step_mixed_bf16,
         "mixed_bf16_jax": step_mixed_bf16}[args.step](rec, args)
    except Exception as exc:
        rec.data["step_error"] = f"{type(exc).__name__}: {exc}"
        rec.data["step_traceback"] = traceback.format_exc()[-4000:]
        print(f"RESULT {args.step}: STEP FAILED {type(exc).__name__}: {exc}", flush=True)
    rec.data["finished"] = True
    rec.save()
    sys.stdout.flush()
    os._exit(0)  # skip teardown: torch/NCCL/JAX threads can abort while Python unloads


if __name__ == "__main__":
    raise SystemExit(main())
