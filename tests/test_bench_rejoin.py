"""bench_rejoin's pure parts on constructed results (no torchrun): group 0's rates before the fault
and during the outage, the rejoin's delays, and the summary against the uninterrupted job."""

from __future__ import annotations

import argparse
from typing import Any

from bench_rejoin import metrics, summary_rows


def _group(step_end_at: list[float], auc: float = 0.7) -> dict[str, Any]:
    return {"config": {"data": {"source": "synthetic", "synthetic": {"batch_size": 10}}, "train": {"warmup_steps": 2}},
            "step_end_at": step_end_at, "sync": {"replica_groups_lost": 1, "replica_groups_joined": 1},
            "dense_replica_max_abs_diff": 0.0, "table_replica_max_abs_diff": 0.0, "auc": auc,
            "samples_computed_total": 1000}


def test_the_outage_is_timed_on_group_0s_own_steps_until_the_rejoined_group_steps() -> None:
    # group 0: a step a second from t=100 to 119, then a step every half second to t=130
    steps = [100.0 + second for second in range(20)] + [120.0 + 0.5 * half for half in range(1, 21)]
    rejoined = _group([125.0, 125.5])
    timeline = {"fault_at": 110.0, "restart_at": 115.0}
    figures = metrics([_group(steps), rejoined], timeline, argparse.Namespace())
    assert figures["group0_samples_per_s_before"] == 8 * 10 * 2 / 8.0  # steps 103 ... 110 after the warm-up's end at 102
    assert figures["group0_samples_per_s_outage"] == (9 + 10) * 10 * 2 / 15.0  # 111 ... 119, then 120.5 ... 125
    assert figures["restart_to_training_s"] == 10.0 and figures["fault_to_training_s"] == 15.0


def test_the_summary_takes_each_seeds_auc_against_its_uninterrupted_job() -> None:
    def run(fault: str, seed: int, auc: float, before: float, outage: float | None) -> dict[str, Any]:
        return {"fault": fault, "seed": seed, "metrics": {
            "group0_samples_per_s_before": before, "group0_samples_per_s_outage": outage, "restart_to_training_s": None,
            "heal_s": None, "dense_spread": 0.0, "table_spread": 0.0, "auc": auc, "samples": 1000}}

    rows = summary_rows([run("uninterrupted", 1, 0.70, 100.0, None), run("killed", 1, 0.699, 100.0, 98.0),
                         run("uninterrupted", 2, 0.71, 100.0, None), run("killed", 2, 0.712, 100.0, 102.0)])
    killed = next(row for row in rows if row["fault"] == "killed")
    assert [round(value, 4) for value in killed["auc_differences"]] == [-0.001, 0.002]
    assert killed["outage_over_before"] == (1.0, 0.98, 1.02)
