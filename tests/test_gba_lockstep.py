"""GBA -> sync when the trainers' steps are paired by another collective (TorchRec-sharded tables).

Each trainer step here ends with an all-reduce on the trainer group, standing in for the next
step's embedding all-to-all. The switch request reaches the trainers in push replies, after
different local steps; acting on it at once, one trainer would enter the switch barrier while the
other is in that all-reduce, and both would hang (or pair mismatched collectives). With
`lockstep_every` they agree on the step first.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from shadowgba.gba.config import GBAConfig
from shadowgba.config import from_dict
from shadowgba.gba.runtime import GBASync
from shadowgba.job.roles import Roles
from shadowgba.ps.transport import Transport
from tests.multiprocess import run_ranks
from tests.test_gba import BATCH, gba_job, loss_on, make_model

pytestmark = pytest.mark.timeout(180)

STEPS = 40
REQUEST_AT = 5
CHECK_EVERY = 4


def paired_steps(ps: Transport) -> dict:
    """GBA from the start; trainer 0 asks for sync after step REQUEST_AT. Trainer 1 pushes each step
    a little later than trainer 0, so the reply to its push carries the request one step before
    trainer 0's does."""
    roles = ps.roles
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    config = from_dict(GBAConfig, {"initial_mode": "gba"})
    switched_after = None
    with GBASync(model, optimizer, config, roles, local_batch_size=BATCH, lockstep_every=CHECK_EVERY, transport=ps) as gba:
        for step in range(STEPS):
            time.sleep(0.03 * roles.trainer_index)  # trainer 1 pushes after trainer 0 has asked for sync
            loss_on(model, roles.trainer_index, step).backward()
            optimizer.step()
            optimizer.zero_grad()
            if switched_after is None and gba.mode == "sync":
                switched_after = step
            if roles.trainer_index == 0 and step == REQUEST_AT:
                gba.switch_mode("sync")
            paired = torch.ones(16, dtype=torch.float64)  # the stand-in for the next step's all-to-all
            dist.all_reduce(paired, group=roles.trainer_group)
            assert torch.equal(paired, torch.full_like(paired, 2.0)), paired
        mode = gba.mode
    return {"switched_after": switched_after, "mode": mode,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


def test_lockstep_trainers_leave_gba_at_the_same_agreed_step() -> None:
    trainers = run_ranks(gba_job, 3, 1, paired_steps, timeout_s=150)[:2]
    steps = {result["switched_after"] for result in trainers}
    assert len(steps) == 1, trainers  # the same step on both
    (step,) = steps
    assert step is not None and step > REQUEST_AT and (step + 1) % CHECK_EVERY == 0, step  # an agreement step
    assert all(result["mode"] == "sync" for result in trainers)
    torch.testing.assert_close(trainers[0]["params"], trainers[1]["params"], rtol=0, atol=0)


def test_lockstep_every_must_not_be_negative() -> None:
    model, roles = make_model(), Roles.assign(0, 2, num_servers=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="lockstep_every must be >= 0, got -1"):
        GBASync(model, optimizer, from_dict(GBAConfig, {"initial_mode": "sync"}), roles, BATCH, lockstep_every=-1)
