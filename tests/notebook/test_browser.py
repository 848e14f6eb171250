"""A real browser runs the quickstart notebook in JupyterLab and sees the dashboard finish; and the
search notebook (07_tune) and sees the search's live view end with its charts and table.

JupyterLab listens on 127.0.0.1 with a token; Debian's chromium (installed by
scripts/install_system_deps.sh) is driven by Playwright. The screenshots are saved to
artifacts/dashboard.png and artifacts/search_dashboard.png.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "artifacts"
EPOCHS = 20  # the quickstart's --epochs

# For each metric chart: {title: {split: [value of the line's last point, y axis span]}}, the value
# read back from screen coordinates through the y axis' tick labels (bqplot keeps no data in the DOM).
LAST_POINTS_JS = """
figs => {
  const screenY = (el, x, y) => {
    const p = el.ownerSVGElement.createSVGPoint(); p.x = x; p.y = y;
    return p.matrixTransform(el.getScreenCTM()).y;
  };
  const out = {};
  for (const f of figs) {
    const title = (f.querySelector('.mainheading') || {}).textContent;
    const ticks = [...f.querySelectorAll('.axis .tick')].filter(t => t.querySelector('line[x2]'))
      .map(t => [parseFloat(t.querySelector('text').textContent), screenY(t, 0, 0)])
      .filter(([v, y]) => !isNaN(v));
    const lines = [...f.querySelectorAll('.curve .line')];
    if (ticks.length < 2 || !lines.length) continue;
    const [v0, y0] = ticks[0], [v1, y1] = ticks[ticks.length - 1];
    out[title] = {};
    for (const line of lines) {
      const stroke = getComputedStyle(line).stroke;
      const split = stroke === 'rgb(31, 119, 180)' ? 'train' : 'validation';
      const last = line.getAttribute('d').split('L').pop().replace('M', '').split(',').map(Number);
      const y = screenY(line, last[0], last[1]);
      out[title][split] = [v0 + (y - y0) * (v1 - v0) / (y1 - y0), Math.abs(v1 - v0)];
    }
  }
  return out;
}
"""

BACKGROUND_CELL = """\
%%dist_train --data X_train,y_train --epochs 500 --batch-size 32 --workers 2 --background --out bg
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    """One JupyterLab server for the module's tests (each opens its own notebook, with its own kernel)."""
    tmp_path = tmp_path_factory.mktemp("lab")
    if not os.path.exists(CHROMIUM):
        pytest.skip("chromium is not installed; run scripts/install_system_deps.sh as root")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (pip install -e '.[test]')")
    work = tmp_path / "nb"
    work.mkdir()
    nb = json.loads((ROOT / "notebooks" / "01_quickstart.ipynb").read_text())
    # Name the kernel so JupyterLab starts it without asking.
    nb.setdefault("metadata", {})["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                                   "language": "python"}
    # Then a --background run, for the browser to stop with the dashboard's Stop button (the kernel
    # is idle, so the click reaches it).
    nb["cells"].append({"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                        "source": BACKGROUND_CELL})
    (work / "quickstart.ipynb").write_text(json.dumps(nb))
    (work / "tune.ipynb").write_text((ROOT / "notebooks" / "07_tune.ipynb").read_text())
    # No "fetch Jupyter news?" toast over the screenshot, and no update check (nothing leaves the machine).
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    token, port = secrets.token_hex(16), _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2",
           "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws")}
    with open(tmp_path / "jupyterlab.log", "w") as log:  # the server keeps its own copy of the descriptor
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}", "--LabApp.news_url=None",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             "--LabApp.extension_manager=readonly"] + (["--allow-root"] if os.getuid() == 0 else []),
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log_text = (tmp_path / "jupyterlab.log").read_text()
                    raise RuntimeError("JupyterLab did not start:\n" + log_text) from None
                time.sleep(0.5)
        yield base, token, tmp_path
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait(5)
        log.close()


@contextlib.contextmanager
def lab_page(tmp):
    """A page of a headless chromium, closed afterwards; the artifacts folder made."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        # A fresh profile directory (Playwright passes it as --user-data-dir).
        browser = p.chromium.launch_persistent_context(
            str(tmp / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            viewport={"width": 1400, "height": 1800},
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            yield browser.new_page()
        finally:
            browser.close()


def run_to_its_dashboard(page, base: str, token: str, notebook: str, last_output: str, selector: str,
                         page_shot: str, dash_shot: str):
    """Run ``notebook`` to the cell output ``last_output``; its dashboard (``selector``), screenshot and saved
    as HTML in the artifacts, with a screenshot of the page (also when the output never came)."""
    open_and_run_all(page, base, token, notebook)
    try:
        page.wait_for_selector(f".jp-OutputArea-output:has-text('{last_output}')", timeout=240_000)
    finally:
        page.screenshot(path=str(ARTIFACTS / f"{page_shot}.png"), full_page=True)
    dash = page.locator(selector).first
    dash.scroll_into_view_if_needed()
    page.wait_for_timeout(1000)  # let the last throttled redraw and chart transitions land
    dash.screenshot(path=str(ARTIFACTS / f"{dash_shot}.png"))
    (ARTIFACTS / f"{dash_shot}.html").write_text(dash.evaluate("e => e.outerHTML"))  # to look into
    return dash


def open_and_run_all(page, base: str, token: str, notebook: str) -> None:
    # reset: a fresh workspace, not the one the previous test left with its notebook's tab open (then two
    # notebooks' indicators match, the first one hidden, and waiting for it to be visible never ends).
    page.goto(f"{base}/lab/tree/{notebook}?reset&token={token}", timeout=60_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell:visible", timeout=60_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']:visible", timeout=90_000)
    page.wait_for_selector(".jp-Spinner", state="detached", timeout=90_000)
    # JupyterLab may ask which kernel to use: take the proposed one (Python 3). Whichever comes first, that
    # question or the named kernel idle (both notebooks name theirs: waiting for a question that never comes
    # cost 15 s a test).
    idle = ".jp-StatusBar-Widget:has-text('Idle')"
    page.wait_for_selector(f".jp-Dialog .jp-mod-accept, {idle}", timeout=90_000)
    accept = page.locator(".jp-Dialog .jp-mod-accept")
    if accept.count():
        accept.first.click()
    page.wait_for_selector(idle, timeout=90_000)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()


def test_quickstart_dashboard_in_jupyterlab(jupyterlab):
    base, token, tmp = jupyterlab
    with lab_page(tmp) as page:
        # The notebook's last cell prints once training ended and model.predict ran.
        dash = run_to_its_dashboard(page, base, token, "quickstart.ipynb", "test accuracy:", ".nbdist-dashboard",
                                    "notebook", "dashboard")
        page.screenshot(path=str(ARTIFACTS / "notebook.png"), full_page=True)
        text = dash.inner_text()
        assert f"Epoch {EPOCHS}/{EPOCHS}" in text, text
        assert text.count("done") >= 3, text  # the run and both workers
        bars = dash.locator(".progress-bar")
        assert bars.count() == 3  # epochs + 2 workers
        for i in range(3):
            style = bars.nth(i).get_attribute("style") or ""
            assert "width: 100%" in style, style
        # bqplot drew the metric charts: one SVG path per line, EPOCHS markers per line.
        titles = dash.locator(".bqplot .mainheading").evaluate_all(
            "els => els.map(e => e.textContent)")
        assert {"loss", "accuracy", "time per phase"} <= set(titles), titles
        # Every line holds every epoch, up to the final one: EPOCHS markers per line, and the
        # x axes end at the final epoch.
        # (The legend draws small .line icons too; the data lines are inside .curve.)
        per_line = dash.locator(".bqplot .curve .line").evaluate_all(
            "els => els.map(e => e.getAttribute('d').split('L').length)")
        assert per_line == [EPOCHS] * 4, per_line
        last_ticks = dash.locator(".bqplot").evaluate_all(
            "figs => figs.map(f => [...f.querySelectorAll('.axis .tick text')].map(t => t.textContent))")
        assert sum(str(EPOCHS) in ticks for ticks in last_ticks) >= 2, last_ticks
        # The phase view: a compute and a synchronisation bar per worker, with a legend.
        # and the timeline: one stacked bar per epoch.
        assert dash.locator(".bqplot .bargroup").count() == 2 + EPOCHS
        # Worker rows name their share of time spent synchronising.
        assert text.count("sync ") >= 2, text
        # The static summary (HTML table + PNG) sits below the dashboard.
        summary = page.locator(".nbdist-summary").first
        assert summary.locator("img.nbdist-chart").count() == 1
        # The charts end at the final values: read each line's last point back through its y axis
        # and compare with the summary table's last row.
        table = summary.locator("table.nbdist-metrics")
        header = table.locator("thead th").all_inner_texts()
        final = dict(zip(header, table.locator("tbody tr").last.locator("td").all_inner_texts()))
        assert final["epoch"] == str(EPOCHS), final
        drawn = dash.locator(".bqplot").evaluate_all(LAST_POINTS_JS)
        for title, split, key in [("loss", "train", "loss"), ("loss", "validation", "val_loss"),
                                  ("accuracy", "train", "accuracy"), ("accuracy", "validation", "val_accuracy")]:
            value, span = drawn[title][split]
            assert abs(value - float(final[key])) < 0.02 * span, (title, split, value, final[key])

        # The background run's dashboard: click Stop once an epoch is shown; the run ends cleanly.
        bg = page.locator(".nbdist-dashboard").nth(1)
        bg.scroll_into_view_if_needed()
        page.wait_for_function(
            "() => /Epoch [1-9]\\d*\\/500/.test(document.querySelectorAll('.nbdist-dashboard')[1].innerText)",
            timeout=120_000)
        stop = bg.locator("button", has_text="Stop")
        assert stop.is_enabled()
        clicked = time.monotonic()
        stop.click()
        bg.locator(".nbdist-status", has_text="stopped").wait_for(timeout=30_000)
        took = time.monotonic() - clicked
        page.locator(".nbdist-summary", has_text="Stopped (stopped from the dashboard)").wait_for(timeout=15_000)
        bg.screenshot(path=str(ARTIFACTS / "dashboard_stopped.png"))
        stopped_text = bg.inner_text()
        assert "stopped" in stopped_text and "/500" in stopped_text, stopped_text
        assert not bg.locator("button", has_text="Stop").is_visible()  # nothing left to stop
        assert took < 20, took


def test_search_dashboard_in_jupyterlab(jupyterlab):
    """07_tune's %%dist_tune in JupyterLab draws the widget view: a best-so-far chart with a point per
    finished trial, each trial's curve with a point per epoch, the table of trials, status done."""
    base, token, tmp = jupyterlab
    with lab_page(tmp) as page:
        dash = run_to_its_dashboard(page, base, token, "tune.ipynb", "best_model test accuracy:",
                                    ".nbdist-search-dashboard", "search_notebook", "search_dashboard")
        text = dash.inner_text()
        assert "search done: 4/4 trials finished" in text and "done" in text, text
        assert dash.locator("table.nbdist-trials tbody tr").count() == 4
        assert dash.locator("table.nbdist-trials td", has_text="complete").count() == 4
        titles = dash.locator(".bqplot .mainheading").evaluate_all("els => els.map(e => e.textContent)")
        assert titles == ["best val_accuracy so far", "val_accuracy per epoch"], titles
        points = dash.locator(".bqplot").evaluate_all(
            "figs => figs.map(f => [...f.querySelectorAll('.curve .line')]"
            ".map(l => l.getAttribute('d').split('L').length))")
        assert points == [[4], [3, 3, 3, 3]], points  # 4 trials finished; 4 trials of 3 epochs
