"""The dashboard without a kernel: the pure view, and the renderers in-process (throttling, restarts,
unknown event kinds, phase view, the summary, an elastic run's changes of workers).

ipywidgets and bqplot models work without a frontend, so the real dashboard is built and fed
real ``RunState`` events here; ``show`` records what would be displayed in the cell.
"""
from __future__ import annotations

import base64
import io
import time

import pytest

from nbdist.driver.state import MembershipChange, RunState
from nbdist.ui import detect_frontend, in_zeppelin
from nbdist.ui.html import HtmlRenderer, progress_html
from nbdist.ui.summary import summary_html
from nbdist.ui.text import TextRenderer
from nbdist.ui.view import Throttle, metric_groups, overview, status_sentence, worker_rows
from nbdist.wire.reports import Epoch, Progress


class Shown:
    """Stands in for IPython's ``display`` outside a kernel: keeps every object and update."""

    def __init__(self) -> None:
        self.items: list = []
        self.updates: list = []

    def __call__(self, obj, display_id=None):
        self.items.append(obj)
        return self

    def update(self, obj) -> None:
        self.updates.append(obj)


def running_state() -> RunState:
    st = RunState(world_size=2, epochs=5)
    for r in range(2):
        st.worker_connected(r, "127.0.0.1", 100 + r)
        st.workers[r].batches = 10
    return st


def epoch(st: RunState, e: int) -> dict:
    merged = None
    for r in range(2):
        merged = st.worker_epoch(r, Epoch(epoch=e, batch=10, batches=10, samples=100, val_samples=0,
                                          seconds=0.5, compute_seconds=1.0 + e, sync_seconds=0.2 * (e + 1),
                                          logs={"loss": 1.0 / (e + 1), "accuracy": 0.5 + 0.1 * e}))
    return merged


@pytest.fixture
def dashboard():
    pytest.importorskip("bqplot")
    from nbdist.ui.widgets import WidgetDashboard

    shown = Shown()
    dash = WidgetDashboard(show=shown)
    yield dash, shown
    dash._cancel_timer()


def test_widget_redraws_are_throttled_to_five_per_second(dashboard):
    dash, _ = dashboard
    st = running_state()
    dash("start", st, None)
    start_draws, t0 = dash.draws, time.monotonic()
    sent = 0
    while time.monotonic() - t0 < 1.5:  # a flood of progress events for 1.5 s
        st.worker_progress(sent % 2, Progress("training", epoch=0, batch=sent % 10, batches=10))
        dash("progress", st, sent % 2)
        sent += 1
        time.sleep(0.001)
    time.sleep(0.3)  # the trailing timer draws the last state once
    draws, elapsed = dash.draws - start_draws, time.monotonic() - t0
    assert sent > 200
    assert 5 <= draws <= 5 * elapsed + 1, (draws, elapsed)


def test_the_last_event_before_a_pause_is_drawn(dashboard):
    dash, _ = dashboard
    st = running_state()
    dash("start", st, None)
    st.worker_progress(0, Progress("training", epoch=0, batch=3, batches=10))
    dash("progress", st, 0)
    st.worker_progress(0, Progress("synchronising", epoch=0, batch=7, batches=10))
    dash("progress", st, 0)  # inside the throttle window: drawn later by the timer, not lost
    time.sleep(0.5)
    assert "synchronising" in dash.worker_states[0].value
    assert dash.worker_bars[0].value == pytest.approx(0.7 / 5)


def test_phase_view_shows_compute_and_synchronisation_per_worker(dashboard):
    dash, _ = dashboard
    st = running_state()
    dash("start", st, None)
    epoch(st, 0)
    epoch(st, 1)
    dash("epoch", st, None)
    dash._draw()
    compute, sync = [list(map(float, row)) for row in dash.phase.bars.y]
    assert compute == [2.0, 2.0] and sync == pytest.approx([0.4, 0.4])
    assert "sync 17%" in dash.worker_states[0].value  # 0.4 of 2.4 s


def test_restarts_are_shown_with_their_reason(dashboard):
    dash, _ = dashboard
    st = running_state()
    dash("start", st, None)
    epoch(st, 0)
    st.restarts = 1  # what RunState.restarting() does (the restart machinery's own branch)
    st.status = "restarting"
    dash("restart", st, "worker 1 (pid 101) was killed by SIGKILL; restarting from epoch 1 (1 of 2)")
    assert dash.notice.layout.display is None
    assert "SIGKILL" in dash.notice.value and "restarted 1×" in dash.notice.value
    assert "restarting" in dash.header.value
    assert "restarted 1×" in overview(st).line
    assert status_sentence(st).startswith("Restarting the workers (restart 1)")
    assert "restarted 1×" in progress_html(st)


def elastic_state() -> RunState:
    """3 workers of an elastic run (``--workers 2:3``) after their first epoch."""
    st = RunState(world_size=3, epochs=5, strategy="allreduce", min_workers=2)
    for r in range(3):
        st.worker_connected(r, "127.0.0.1", 100 + r)
        st.workers[r].batches = 10
    for r in range(3):
        st.worker_epoch(r, Epoch(epoch=0, batch=10, batches=10, samples=100, val_samples=0, seconds=0.5,
                                 compute_seconds=1.0, sync_seconds=0.2, logs={"loss": 1.0}))
    return st


def lose_worker_2(st: RunState) -> MembershipChange:
    """Worker 2 is killed in the second epoch; workers 0 and 1 go on (what driver/training.py does to the
    state: ``workers_left``, then ``regrouped``)."""
    st.workers_left({2}, 2)
    change = MembershipChange(generation=1, left=[2], why="was killed by SIGKILL", workers=[0, 1], committed=1,
                              steps_lost=5)
    st.regrouped(change)
    return change


def test_a_membership_change_is_shown_and_the_lost_worker_is_gone(dashboard):
    dash, shown = dashboard
    st = elastic_state()
    html_updates = Shown()
    renderers = [dash, HtmlRenderer("update", show=html_updates), HtmlRenderer("append", show=shown)]
    for r in renderers:
        r("start", st, None)
    change = lose_worker_2(st)
    for r in renderers:
        r("membership", st, change)
    line = "worker 2 left (was killed by SIGKILL); going on with 2 workers from the commit after epoch 1, 5 steps lost"
    rows = worker_rows(st)
    assert [r.state for r in rows] == ["training", "training", "gone"] and "left in epoch 2" in rows[2].detail
    assert "1 worker gone" in overview(st).line
    page = progress_html(st)
    assert f"{line} (now workers 0, 1)" in page and "<b>gone</b>" in page and "<b>failed</b>" not in page
    assert "workers changed 1×" in html_updates.updates[-1].data  # redrawn at once, not throttled
    assert line in shown.items[-1].data and "nbdist-membership" in shown.items[-1].data  # append: a block
    assert dash.changes.layout.display is None and line in dash.changes.value
    assert "<b>gone</b>" in dash.worker_states[2].value and dash.worker_bars[2].bar_style == ""
    assert "<b>training</b>" in dash.worker_states[0].value
    # A replacement, worker 3, joins at the next commit: a row of its own in every renderer, and a line.
    st.joiner_added(3)
    joined = MembershipChange(generation=2, left=[], why="", workers=[0, 1, 3], committed=2, steps_lost=0,
                              joined=[3])
    st.regrouped(joined)
    out = io.StringIO()
    for r in [*renderers, TextRenderer(out)]:
        r("membership", st, joined)
    joined_line = "worker 3 joined at the commit after epoch 2; training with 3 workers"
    assert out.getvalue() == f"nbdist: {joined_line}\n"
    assert [r.state for r in worker_rows(st)] == ["training", "training", "gone", "starting"]
    assert f"{joined_line} (now workers 0, 1, 3)" in progress_html(st) and "workers changed 2×" in progress_html(st)
    assert joined_line in shown.items[-1].data and joined_line in dash.changes.value
    assert len(dash.worker_bars) == 4 and "<b>starting</b>" in dash.worker_states[3].value
    assert "1 worker gone" in overview(st).line
    st.finish("done")
    assert line in summary_html(st) and "<b>gone</b>" in summary_html(st) and joined_line in summary_html(st)

    # Below MIN, --max-restarts relaunches every worker under the launch ranks again: none of them is gone.
    relaunched = elastic_state()
    lose_worker_2(relaunched)
    relaunched.restarting(completed=1)
    assert "gone" not in [r.state for r in worker_rows(relaunched)] and "gone" not in overview(relaunched).line
    assert relaunched.membership and relaunched.relaunched_at == len(relaunched.membership)

    late = RunState(world_size=3, epochs=5, strategy="allreduce", min_workers=2)  # one never started
    late.regrouped(MembershipChange(generation=0, left=[2], why="did not connect within 60 s", workers=[0, 1],
                                    committed=0, steps_lost=0, started=False))
    row = worker_rows(late)[2]
    assert (row.state, row.detail) == ("gone", "did not start (did not connect within 60 s)")
    late.regrouped(MembershipChange(generation=1, left=[], why="", workers=[0, 1, 2], committed=1, steps_lost=0,
                                    joined=[2]))  # it connected later and joined: not gone any more
    assert worker_rows(late)[2].state == "starting" and "gone" not in overview(late).line


def test_renderers_accept_unknown_kinds_silently(dashboard):
    dash, shown = dashboard
    st = running_state()
    out = io.StringIO()
    renderers = [dash, TextRenderer(out), HtmlRenderer("update", show=shown), HtmlRenderer("append", show=shown)]
    for r in renderers:
        r("start", st, None)
    n_items = len(shown.items)
    for r in renderers:
        r("something-new", st, {"x": 1})
    assert len(shown.items) == n_items  # nothing appended for a kind nobody knows
    assert out.getvalue().count("\n") == 1  # only the start line


def test_html_append_mode_adds_a_block_per_restart():
    shown = Shown()
    r = HtmlRenderer("append", show=shown)
    st = running_state()
    r("start", st, None)
    r("restart", st, "worker 0 exited with code 1; restarting from epoch 2")
    assert "restarting from epoch 2" in shown.items[-1].data


def test_a_failed_run_opens_the_error_panel_with_the_workers_traceback(dashboard):
    dash, shown = dashboard
    st = running_state()
    dash("start", st, None)
    st.worker_finished(1, "failed", 'Traceback (most recent call last):\n  File "x.py"\nValueError: bad <input>')
    st.finish("failed", "worker 1 (pid 101) failed: ValueError: bad <input>")
    dash("end", st, None)
    assert dash.error_panel.layout.display is None
    assert "traceback from worker 1" in dash.error_panel.value
    assert "ValueError: bad &lt;input&gt;" in dash.error_panel.value  # escaped, not HTML
    assert "failed" in dash.worker_states[1].value and dash.worker_bars[1].bar_style == "danger"
    assert dash.stop_button.layout.display == "none"
    assert "nbdist-summary" in shown.updates[-1].data  # the static summary replaced the placeholder


def test_phase_timeline_holds_each_epochs_seconds_and_rewinds_on_restart(dashboard):
    from nbdist.ui.view import EpochPhases

    dash, _ = dashboard
    st = running_state()
    dash("start", st, None)
    for e in range(3):
        dash("epoch", st, epoch(st, e))  # cumulative: compute 1, 2, 3 s; sync 0.2, 0.4, 0.6 s
    dash._draw()
    assert list(map(int, dash.timeline.bars.x)) == [1, 2, 3]
    compute, sync = [list(map(float, row)) for row in dash.timeline.bars.y]
    assert compute == pytest.approx([1.0, 1.0, 1.0]) and sync == pytest.approx([0.2, 0.2, 0.2])
    phases = EpochPhases(compute=[1.0, 1.0, 1.0], sync=[0.2, 0.2, 0.2], _last=(3.0, 0.6))
    phases.restart(1)  # workers relaunched after epoch 1: they count from zero again
    st2 = running_state()
    epoch(st2, 0)
    phases.mark(st2)
    assert phases.compute == pytest.approx([1.0, 1.0]) and phases.sync == pytest.approx([0.2, 0.2])


def test_epoch_ticks_label_whole_epochs_and_the_last_one():
    from nbdist.ui.view import epoch_ticks

    assert epoch_ticks([]) == []
    assert epoch_ticks([1, 2, 3, 4]) == [1, 2, 3, 4]
    ticks = epoch_ticks(list(range(1, 201)))
    assert len(ticks) <= 10 and ticks[-1] == 200 and all(isinstance(t, int) for t in ticks)
    assert epoch_ticks(list(range(6, 27)))[-1] == 26  # resumed runs start later


def test_one_epoch_still_draws_a_whole_bar_and_a_readable_axis(dashboard):
    dash, _ = dashboard
    st = running_state()
    dash("start", st, None)
    dash("epoch", st, epoch(st, 0))
    dash._draw()
    assert list(map(int, dash.timeline.bars.x)) == [0, 1]  # an empty bar at 0 gives the real one its width
    assert (dash.timeline.x_scale.min, dash.timeline.x_scale.max) == (0.5, 1.5)  # ...and stays off the axis
    chart = dash.charts["loss"]
    assert chart.y_scale.min < 1.0 < chart.y_scale.max  # a single loss of 1.0 sits inside a real range
    dash("epoch", st, epoch(st, 1))
    dash._draw()
    assert chart.y_scale.min is None and list(map(int, dash.timeline.bars.x)) == [1, 2]


def test_the_sessions_ui_setting_is_what_a_run_without_ui_shows() -> None:
    """`make demo` runs headless in a real kernel: ``%config DistMagics.ui = "text"`` (scripts/run_notebook.py
    passes ``--DistMagics.ui=text``) makes the magics' runs without --ui print lines."""
    from traitlets import TraitError

    from nbdist.magics.train import session_options
    from nbdist.ui import make_renderer
    from nbdist.ui.text import TextRenderer

    from ..conftest import ipython_shell

    shell = ipython_shell()
    magics = shell.magics_manager.registry["DistMagics"]
    assert session_options(shell)["ui"] == "auto"
    shell.run_line_magic("config", "DistMagics.ui = 'text'")
    try:
        assert session_options(shell)["ui"] == "text"
        assert isinstance(make_renderer(session_options(shell)["ui"]), TextRenderer)
        with pytest.raises(TraitError, match=r"^unknown ui 'fancy'; use one of: auto, widgets, html, text, none\.$"):
            magics.ui = "fancy"  # refused when set, in TrainConfig's sentence
        assert magics.ui == "text"
    finally:
        magics.ui = "auto"


# -- the pure view and the summary -----------------------------------------------------------------

def finished_state(epochs: int = 3) -> RunState:
    st = RunState(world_size=2, epochs=epochs)
    for r in range(2):
        st.worker_connected(r, "127.0.0.1", 100 + r)
    for e in range(epochs):
        for r in range(2):
            st.worker_epoch(r, Epoch(epoch=e, batch=10, batches=10, samples=100, val_samples=20,
                                     seconds=0.5, compute_seconds=0.4 * (e + 1), sync_seconds=0.1 * (e + 1),
                                     logs={"loss": 1.0 / (e + 1), "accuracy": 0.5 + 0.1 * e,
                                           "val_loss": 1.2 / (e + 1), "val_accuracy": 0.4 + 0.1 * e}))
    for r in range(2):
        st.worker_finished(r, "done")
    st.finish("done")
    return st


def test_view_of_a_finished_run():
    st = finished_state()
    ov = overview(st)
    assert (ov.epochs_done, ov.epochs_total, ov.eta, ov.throughput) == (3, 3, "0.0s", 400.0)
    rows = worker_rows(st)
    assert [r.state for r in rows] == ["done", "done"] and [r.fraction for r in rows] == [1.0, 1.0]
    assert rows[0].sync_fraction == pytest.approx(0.2)
    groups = metric_groups(st.history)
    assert set(groups) == {"loss", "accuracy"}
    assert groups["loss"]["validation"] == pytest.approx([1.2, 0.6, 0.4])


def test_worker_fraction_counts_epochs_and_batches():
    st = RunState(world_size=1, epochs=4)
    st.worker_progress(0, Progress("training", epoch=1, batch=5, batches=10))
    assert worker_rows(st)[0].fraction == pytest.approx(1.5 / 4)
    assert st.eta is None and overview(st).eta == "–"


def test_throttle_allows_at_most_five_per_second():
    now = [0.0]
    t = Throttle(clock=lambda: now[0])
    passed = 0
    for _ in range(1000):  # 1000 events over 2 seconds
        now[0] += 0.002
        passed += t.ready()
    assert passed <= 10 + 1
    assert t.ready(force=True)


def test_summary_has_table_and_chart_image():
    page = summary_html(finished_state())
    assert page.count("<tr><td>") >= 3 + 2  # 3 epochs + 2 workers
    assert "data:image/png;base64," in page
    png = base64.b64decode(page.split("data:image/png;base64,")[1].split('"')[0])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_summary_of_a_failed_run_shows_the_traceback():
    st = RunState(world_size=2, epochs=2)
    st.worker_finished(1, "failed", "Traceback (most recent call last):\nValueError: boom")
    st.finish("failed", "worker 1 failed: boom")
    page = summary_html(st)
    assert "ValueError: boom" in page and "worker 1 failed" in page


def test_auto_picks_text_outside_a_kernel_and_html_in_zeppelin():
    assert detect_frontend(shell=None) == "text"

    class Shell:  # a terminal IPython has no kernel attribute
        pass

    assert detect_frontend(shell=Shell()) == "text"

    class Kernel:
        comm_manager = object()

    class KernelShell:
        kernel = Kernel()

    assert detect_frontend(shell=KernelShell(), zeppelin=False) == "widgets"
    assert detect_frontend(shell=KernelShell(), zeppelin=True) == "html"
    Kernel.comm_manager = None
    assert detect_frontend(shell=KernelShell(), zeppelin=False) == "html"


def test_zeppelin_is_known_by_the_launcher_it_starts_kernels_with():
    """Zeppelin's IPython interpreter runs kernel_server.py from a zeppelin_jupyter_kernel_* temporary directory
    (its parent process) and puts that directory's py4j zip on PYTHONPATH; ZEPPELIN_HOME alone says nothing."""
    server = ["/usr/bin/python3", "/tmp/zeppelin_jupyter_kernel_python8312/kernel_server.py", "python", "40123"]
    assert in_zeppelin(parent_command=server, pythonpath="")
    py4j = "/tmp/zeppelin_jupyter_kernel_python8312/py4j-src-0.10.9.7.zip"
    assert in_zeppelin(parent_command=["/usr/bin/python3"], pythonpath=f"{py4j}:/opt/lib")
    lab = ["/usr/bin/python3", "/usr/local/bin/jupyter-lab", "--no-browser"]
    assert not in_zeppelin(parent_command=lab, pythonpath="/opt/zeppelin/interpreter/python")
    assert not in_zeppelin(parent_command=["python", "/srv/app/kernel_server.py"], pythonpath="")


def test_the_elastic_start_line_says_how_many_it_goes_on_with():
    for least, words in ((1, "goes on while 1 is left"), (2, "goes on while 2 are left")):
        out = io.StringIO()
        TextRenderer(out)("start", RunState(world_size=3, epochs=5, strategy="allreduce", min_workers=least), None)
        assert f"on 3 local workers (elastic: {words}), 5 epochs" in out.getvalue(), out.getvalue()
