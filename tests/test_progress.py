"""The training bar (lab/report/progress.py): nothing shown before a step is read, and off a
terminal one plain line per logged step instead of a live bar."""

import io

from rich.console import Console

from lab.report import progress


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=120), out


def _shown(bar) -> str:
    """The bar's row as the terminal would draw it."""
    con, out = _console(terminal=False)
    con.print(bar.make_tasks_table(bar.tasks))
    return out.getvalue()


def test_the_bar_shows_no_loss_before_the_first_step_is_read():
    con, _ = _console(terminal=True)
    with progress.training(con) as bar:
        task = bar.add_task("train", total=10, completed=0)
        before = _shown(bar)
        bar.step(task, 1, 5.4321, 2048.0, 0.5, logged=True)
        after = _shown(bar)
    assert "loss –" in before and "– tok/s" in before and "nan" not in before, before
    assert "loss 5.4321" in after and "2,048 tok/s" in after, after


def test_on_a_terminal_the_bar_prints_no_step_lines():
    con, out = _console(terminal=True)
    with progress.training(con) as bar:
        task = bar.add_task("train", total=4, completed=0)
        bar.step(task, 2, 5.0, 100.0, 0.1, logged=True)
    assert "step 2/4  loss" not in out.getvalue()


def test_off_a_terminal_each_logged_step_is_one_plain_line():
    con, out = _console(terminal=False)
    with progress.training(con) as bar:
        task = bar.add_task("train", total=8, completed=2)  # resumed from step 2
        bar.step(task, 3, 6.0, 1000.0, 0.01, logged=False)
        bar.step(task, 4, 5.25, 1234.0, 0.02, logged=True)
    (line,) = out.getvalue().splitlines()
    assert line.startswith("step 4/8  loss 5.2500  1,234 tok/s  20.00 ms/step  elapsed 0:00:0")
    assert "left 0:00:0" in line and "\x1b" not in line, line


def test_a_step_line_says_the_time_left_as_the_bar_does():
    line = progress.step_line(50, 200, 3.14159, 12345.6, 2.5, 125.0, 3725.4)
    assert line == (
        "step 50/200  loss 3.1416  12,346 tok/s  2.50 s/step  elapsed 0:02:05  left 1:02:05"
    )
    assert progress.step_line(1, 2, 1.0, 1.0, 1.0, 0.0, None).endswith("left –")
