"""The PI-against-YaRN report: steps to a common loss and their ratio, from logged curves."""

from __future__ import annotations

from pathlib import Path

from bench.extension_training import Curve, plot, settling_table, steps_table

PI = Curve("zoo-rope-pi4", ((0, 4.4), (10, 3.0), (20, 2.5), (30, 2.2)))
YARN = Curve("zoo-rope-yarn4", ((0, 2.6), (10, 2.3), (20, 2.1), (30, 2.0)))


def test_the_common_loss_is_the_worse_final_and_the_ratio_counts_steps_to_it() -> None:
    lines, ratio = steps_table(PI, YARN)
    assert lines[2] == "| 2.200 | 30 | 20 | 1.50 |"
    assert ratio == 1.5
    assert PI.first_step_at(1.0) is None and YARN.first_step_at(5.0) == 0


def test_a_run_already_at_the_loss_has_no_ratio_only_a_statement() -> None:
    late = Curve("pi", ((0, 4.0), (10, 2.7)))
    lines, ratio = steps_table(late, YARN)
    assert ratio is None and lines[2] == "| 2.700 | 10 | 0 (at the start) | YaRN needs none |"


def test_settling_counts_steps_to_each_runs_own_final_and_the_plot_is_written(tmp_path: Path) -> None:
    assert settling_table((PI,))[-1] == "| zoo-rope-pi4 | 2.200 | 30 | 30 | 30 | 30 |"
    plot([PI, YARN], tmp_path / "steps.png")
    assert (tmp_path / "steps.png").stat().st_size > 10_000
