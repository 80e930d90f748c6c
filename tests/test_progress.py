"""The harness's progress outside a terminal (`dlrm.progress`): plain lines every few seconds, not a
bar redrawn with carriage returns into a log."""

from __future__ import annotations

import io

from dlrm.progress import LineProgress, progress


def test_outside_a_terminal_progress_is_a_plain_line_every_few_seconds_and_one_at_the_end() -> None:
    clock, log = [0.0], io.StringIO()
    bar = LineProgress(total=100, initial=0, stream=log, every_s=5.0, clock=lambda: clock[0])
    for _ in range(30):  # 30 steps over 15 s: lines at 5, 10 and 15 s
        clock[0] += 0.5
        bar.update()
        bar.set_postfix(loss="0.6931", refresh=False)
    bar.close()
    lines = log.getvalue().splitlines()
    assert lines == ["step 10/100 (2.0 steps/s) loss=0.6931", "step 20/100 (2.0 steps/s) loss=0.6931",
                     "step 30/100 (2.0 steps/s) loss=0.6931", "step 30/100 (2.0 steps/s) loss=0.6931"]
    assert "\r" not in log.getvalue()


def test_progress_picks_lines_for_a_log_and_writes_nothing_when_disabled() -> None:
    log = io.StringIO()  # not a terminal
    assert isinstance(progress(total=None, initial=5, enabled=True, stream=log), LineProgress)
    silent = progress(total=10, initial=0, enabled=False, stream=log)
    silent.update()
    silent.close()
    assert log.getvalue() == ""
