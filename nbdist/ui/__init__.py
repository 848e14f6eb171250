"""Renderers of a run's progress. Each is a listener: ``renderer(kind, state, payload)``.

kind is one of "start", "worker", "progress", "epoch" (payload: merged logs), "restart" (payload:
the reason, one sentence), "membership" (an elastic run's change of workers: a ``MembershipChange``)
and "end"; a renderer ignores kinds it does not know.
A renderer may also have ``attach(job)``: it is then given the job (Stop button, worker logs).
This module picks and makes one (``detect_frontend``, ``make_renderer``, ``make_search_view``); the others:

view.py: what the dashboard shows, computed from a ``RunState`` (pure: no widgets, no IPython).
widgets.py: the live dashboard: ipywidgets for progress and state, bqplot for the charts.
html.py: progress as HTML where widgets do not render (Zeppelin's IPython interpreter).
text.py: plain-text progress: one line per epoch, Keras style.
summary.py: the static end-of-run summary a saved notebook keeps (an HTML table and a PNG chart).
report.py: an evaluation result as a table (HTML in a notebook, text in a terminal).
search.py: the live view of a hyperparameter search: trials, best so far, each trial's curve.
search_widgets.py: that view as widgets (HTML tables and bqplot charts).
tracking.py: MLflow tracking: one MLflow run per nbdist run, logged from the notebook.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from ..driver.state import RunState

Listener = Callable[[str, RunState, Any], None]


def detect_frontend(shell: Any = None, zeppelin: bool | None = None) -> str:
    """Which renderer ``--ui auto`` means here: "widgets", "html" or "text".

    widgets: a Jupyter kernel (ipykernel) with a comm manager and ipywidgets + bqplot installed.
    html: Zeppelin's IPython interpreter (``in_zeppelin``: it renders HTML but no widgets), or a kernel
    without widget support. text: a terminal IPython or plain Python.
    """
    if shell is None:
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:
            shell = None
    if shell is None:
        return "text"
    kernel = getattr(shell, "kernel", None)
    if kernel is None:  # TerminalInteractiveShell and other in-process shells without a frontend
        return "text"
    if in_zeppelin() if zeppelin is None else zeppelin:
        return "html"
    if not _has_comms(kernel):
        return "html"
    try:
        import bqplot  # noqa: F401
        import ipywidgets  # noqa: F401
    except ImportError:
        return "html"
    return "widgets"


# Zeppelin's IPython interpreter (JupyterKernelInterpreter in its source) copies its kernel_server.py into a
# new temporary directory named zeppelin_jupyter_kernel_<kernel name>..., runs it with Python, and that
# script starts the kernel with jupyter_client: the kernel's parent process runs that file. The same
# directory holds the py4j zip that IPythonInterpreter puts first on the kernel's PYTHONPATH.
_ZEPPELIN_DIR = "zeppelin_jupyter_kernel_"


def in_zeppelin(parent_command: list[str] | None = None, pythonpath: str | None = None) -> bool:
    """Whether this kernel was started by Zeppelin's IPython interpreter: its parent process runs Zeppelin's
    kernel_server.py, or its PYTHONPATH holds that launcher's directory. Where Zeppelin's server and
    interpreters happen to have ZEPPELIN_HOME set says nothing about who started a kernel."""
    if parent_command is None:
        parent_command = _parent_command()
    if pythonpath is None:
        pythonpath = os.environ.get("PYTHONPATH", "")
    launcher = any(os.path.basename(arg) == "kernel_server.py" and _ZEPPELIN_DIR in arg for arg in parent_command)
    return launcher or any(_ZEPPELIN_DIR in os.path.basename(os.path.dirname(p)) for p in pythonpath.split(os.pathsep))


def _parent_command() -> list[str]:
    """The parent process's command line: /proc on Linux, ``ps`` elsewhere; [] when neither tells."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        pass
    import subprocess

    try:
        out = subprocess.run(["ps", "-o", "args=", "-p", str(ppid)], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split()


def _has_comms(kernel: Any) -> bool:
    # ipykernel gives its kernel a comm manager; kernels that cannot talk to widgets have none.
    return getattr(kernel, "comm_manager", None) is not None


def make_renderer(ui: str, stream: TextIO | None = None) -> Listener | None:
    """The renderer for ``--ui`` (TrainConfig.ui); ``auto`` means ``detect_frontend()``. A headless kernel
    (``make demo``, a CI job) sets its session's default instead: ``%config DistMagics.ui = "text"``."""
    if ui == "none":
        return None
    if ui == "auto":
        ui = detect_frontend()
    if ui == "text":
        from .text import TextRenderer

        return TextRenderer(stream or sys.stdout)
    if ui == "html":
        from .html import HtmlRenderer

        return HtmlRenderer("append" if in_zeppelin() else "update")
    if ui == "widgets":
        try:
            from .widgets import WidgetDashboard
        except ImportError as exc:
            raise _no_widgets(exc) from None
        return WidgetDashboard()
    from ..errors import NbdistError

    raise NbdistError(f"unknown ui {ui!r}; use one of: auto, widgets, html, text, none.")


def _no_widgets(exc: ImportError) -> Exception:
    from ..errors import NbdistError

    return NbdistError(f"--ui widgets needs ipywidgets and bqplot ({exc}); pip install 'nbdist[widgets]' or use "
                       "--ui html.")


def make_search_view(ui: str, stream: TextIO | None = None) -> Any:
    """The live view of a search (ui/search.py, ui/search_widgets.py) for ``--ui``; auto as ``make_renderer``."""
    if ui == "auto":
        ui = detect_frontend()
    if ui == "none":
        return None
    from .search import HtmlSearchView, TextSearchView

    if ui == "text":
        return TextSearchView(stream)
    if ui == "widgets":
        try:
            from .search_widgets import WidgetSearchView
        except ImportError as exc:
            raise _no_widgets(exc) from None
        return WidgetSearchView()
    return HtmlSearchView("append" if in_zeppelin() else "update")
