"""A lost replica group rejoins: a 2D job launched as one torchrun job per replica group.

The membership's decisions (`shadowgba.job.survivors`) on a store in this process: a loss, a join
request from the group's next process set, the members letting it in at the same point, the
joiner replaying the history, and a stale request refused. Then the whole path under torchrun:
the replica store (`python -m shadowgba.replica_store`), two torchrun jobs of the harness (ma, 2
groups of 2 ranks), a rank of group 1 SIGKILLed at a step; group 1's agent restarts that group
alone, its new processes ask to join, group 0 lets them in after a round and hands them its replica,
and the job ends with identical replicas across the groups, written by group 0, which never
restarted; the restarted group resumes its data position from its own checkpoint.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from shadowgba.errors import SetupError, SyncError
from shadowgba.job.heartbeat import Heartbeat
from shadowgba.job.notices import NoticeBoard
from shadowgba.job import survivors
from shadowgba.job.survivors import INCARNATION, SurvivingGroups
from tests.test_checkpoint import SMALL

REPO = Path(__file__).resolve().parents[1]


def _member(store: dist.Store, rank: int, timeout_s: float = 2.0, rejoins: bool = True) -> SurvivingGroups:
    """Rank `rank`'s view of a job of 2 groups of 2 ranks, its board in `store`."""
    return SurvivingGroups(range(4), rank, 2, NoticeBoard("job", store, attempt=0), timeout_s=timeout_s, store=store,
                           rejoins=rejoins)


def _beating(store: dist.Store, ranks: list[int]) -> list[Heartbeat]:
    """Heartbeats of `ranks` on the job's board: the peers alive (the others read as silent)."""
    return [Heartbeat(NoticeBoard("job", store, attempt=0), rank).start() for rank in ranks]


def test_a_loss_then_a_join_are_decided_once_and_replayed_by_the_joiner() -> None:
    store = dist.HashStore()
    beats = _beating(store, [0, 1, 3])
    zero, one = _member(store, 0), _member(store, 1)
    assert not zero.joins_waiting()
    zero.agree(RuntimeError("round failed"), flagged=[2])  # rank 2's abort flag: group 1 out
    one.agree(RuntimeError("round failed"))  # the same decision, read
    assert zero.members == one.members == (0,) and zero.survivors() == (0, 1) and zero.epoch == one.epoch == 1
    with pytest.raises(SyncError, match="rank 2 lost .* replica group 1 \\(ranks 2, 3\\) is out"):
        _member(store, 3).agree(RuntimeError("round failed"))  # a rank of the lost group ends

    joiner = _member(store, 2)
    zero.notices.count(INCARNATION, 1, add=2)  # group 1's process set 2 runs
    joiner.request_join(2)
    assert zero.joins_waiting() and one.joins_waiting()
    zero.admit()
    one.admit()  # both let it in, by one decision
    assert zero.joined == one.joined == {1: 2} and zero.members == one.members == (0, 1)
    joiner.wait_to_join(2, timeout_s=2.0)
    assert joiner.rejoining and joiner.epoch == zero.epoch == one.epoch == 2 and joiner.members == (0, 1)
    assert not zero.joins_waiting()
    assert joiner.heal_source() == zero.heal_source() == 0  # every position takes group 0's replica

    joiner.request_join(2)  # the same process set again: stale, decided as a change of nobody
    assert zero.joins_waiting() and one.joins_waiting()
    zero.admit()
    one.admit()
    assert zero.epoch == one.epoch == 3 and zero.members == (0, 1) and not zero.joined
    assert not zero.joins_waiting() and not one.joins_waiting()
    with pytest.raises(SetupError, match="replica group 1 asked to join the running job and was not let in"):
        _member(store, 3).wait_to_join(3, timeout_s=1.0)
    for beat in beats:
        beat.stop()


def test_a_group_whose_next_process_set_runs_is_taken_as_lost() -> None:
    """Evidence of a loss that no notice shows: the group's successor already cleared its notices."""
    store = dist.HashStore()
    beats = _beating(store, [0, 1, 2, 3])  # group 1's new ranks beat: no silence names them
    zero = _member(store, 0)
    zero.notices.count(INCARNATION, 1, add=2)
    zero.agree(RuntimeError("round failed"))
    assert zero.members == (0,) and zero.lost == (1,)
    for beat in beats:
        beat.stop()


def test_a_survivor_that_learns_the_decision_late_is_still_met_and_one_that_never_comes_is_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The members of a new epoch meet before they make its groups (`SurvivingGroups.groups`): a rank
    that comes later than `sync.timeout_s` (here 0.5 s; e.g. a rank that waited out a looker of the
    lost group) is still met within `MEETING_LAG_S`; a member that never comes ends the wait with a count."""
    monkeypatch.setattr(survivors, "MEETING_LAG_S", 2.0)
    store = dist.HashStore()
    beats = _beating(store, [0, 1, 2, 3])  # every heartbeat alive: rank 2's flag alone decides
    zero, one = (_member(store, rank, timeout_s=0.5, rejoins=False) for rank in (0, 1))
    zero.agree(RuntimeError("round failed"), flagged=[2])
    one.agree(RuntimeError("round failed"))
    assert zero.survivors() == one.survivors() == (0, 1)
    late = threading.Timer(1.0, one._meet)  # past zero's timeout_s, within MEETING_LAG_S
    started = time.monotonic()
    late.start()
    zero._meet()
    late.join()
    assert 0.9 < time.monotonic() - started < 2.0
    zero._made += 1  # the epoch's next set of groups: rank 1 never comes
    with pytest.raises(SyncError, match="1 of the 2 member ranks came to make epoch 1's groups within 2 s"):
        zero._meet()
    for beat in beats:
        beat.stop()


@pytest.mark.timeout(240)
def test_a_group_restarted_by_its_own_agent_rejoins_and_the_replicas_end_identical(tmp_path: Path) -> None:
    from example_job import replica_store, start_replica_group

    fault_log = tmp_path / "faults.jsonl"
    arguments = ["--config", "examples/configs/ma_2d.yaml", *SMALL, "--data.synthetic.eval_batches", "4", "--sync.timeout_s", "20",
                 "--sync.on_group_lost", "continue", "--sync.max_round_share", "1", "--sync.max_step_cost", "1"]
    # group 0 trains for 30 s, long enough for group 1's agent to restart it (Python, torch and
    # TorchRec imported again, the model built); group 1 trains to step 60 each time, saving a
    # checkpoint every 10 steps, and its restart resumes its position from the last one (its weights
    # come from group 0's replica: newer than the checkpoint's)
    checkpoints = tmp_path / "checkpoints"
    lengths = [["--train.duration_s", "30"],
               ["--train.steps", "60", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "10", "--resume"]]
    with replica_store() as store:
        jobs = [start_replica_group(group, 2, store, 2, [*arguments, *lengths[group]], tmp_path / f"group{group}.json",
                                    {"SHADOWGBA_TEST_FAULT_LOG": str(fault_log),
                                     **({"SHADOWGBA_TEST_KILL_AT_STEP": "3:20"} if group else {})}, max_restarts=1)
                for group in (0, 1)]
        logs = [job.communicate(timeout=200)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], "\n".join(log[-4000:] for log in logs)
    fired = [json.loads(line) for line in fault_log.read_text().splitlines()]
    assert [(event["kind"], event["trainer"], event["step"], event["restart_count"]) for event in fired] == [
        ("kill", 3, 20, 0)]
    assert "replica group 1 (process set 2) asks to rejoin the job" in logs[1], logs[1][-4000:]
    assert "replica group 1 rejoined (epoch 2)" in logs[0], logs[0][-4000:]
    results, rejoined = (json.loads((tmp_path / f"group{group}.json").read_text()) for group in (0, 1))
    assert results["restart_count"] == 0 and results["steps"] > 60, results  # group 0 never restarted
    assert rejoined["restart_count"] == 1 and rejoined["steps"] == 60, rejoined  # group 1's second process set
    resumed_from = rejoined["checkpoint"]["resumed_from_step"]  # the step 20 save, or 10's if 20's was in flight
    assert resumed_from in (10, 20) and rejoined["checkpoint"]["resumed_position_only"], rejoined["checkpoint"]
    assert sorted(path.name for path in checkpoints.iterdir()) == ["group1"]  # its own folder, apart from group 0's
    assert rejoined["dense_replica_max_abs_diff"] == 0.0 and rejoined["auc"] == results["auc"], rejoined
    assert results["sync"]["replica_groups_lost"] == 1 and results["sync"]["replica_groups_joined"] == 1, results["sync"]
    assert results["departed_trainers"] == [] and results["trainers"] == 4, results
    assert results["dense_replica_max_abs_diff"] == 0.0 and results["table_replica_max_abs_diff"] == 0.0, results
    assert 0.5 < results["auc"] < 1.0, results
