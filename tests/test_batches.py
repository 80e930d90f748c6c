"""Malformed batches for TorchRec-sharded tables are refused on the rank that got them, naming the
feature, the table and the bad value, before TorchRec's input distribution sees them
(`shadowgba.integrations.torchrec.BatchCheck`, installed by `ShardingGuard` on every DMP a trainer of a
job with servers builds).

The distributed case (`malformed_on_one_trainer`, a tiny DMP over 2 trainers + 1 server) runs in the
3-rank group that tests/test_checkpoint.py spawns anyway (one spawned group less); its assertions
are `assert_refused_by_the_trainer_that_got_it`, called from there."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from shadowgba.integrations.torchrec import BatchCheck

TABLES = [EmbeddingBagConfig(name="users", embedding_dim=4, num_embeddings=10, feature_names=["user", "friend"]),
          EmbeddingBagConfig(name="items", embedding_dim=4, num_embeddings=5, feature_names=["item"])]
"""Two features share a table, so a message must name the feature and its table apart."""

MALFORMED: dict[str, tuple[list[str], list[int], list[int], str]] = {
    "unknown key": (["user", "friend", "colour"], [1, 2, 3], [1, 1, 1],
                    "unknown feature 'colour'; the tables' features are \\['friend', 'item', 'user'\\]"),
    "missing key": (["user", "friend"], [1, 2], [1, 1], "feature 'item' of table 'items': missing"),
    "repeated key": (["user", "friend", "friend"], [1, 2, 3], [1, 1, 1],
                     "feature 'item' of table 'items': missing \\(keys \\['user', 'friend', 'friend'\\]\\)"),
    "negative id": (["user", "friend", "item"], [1, -2, 3], [1, 1, 1],
                    "feature 'friend' of table 'users': id -2 out of range \\[0, 10\\)"),
    "id beyond the table": (["user", "friend", "item"], [1, 2, 5], [1, 1, 1],
                            "feature 'item' of table 'items': id 5 out of range \\[0, 5\\)"),
    "lengths beyond the values": (["user", "friend", "item"], [1, 2, 3], [1, 2, 1],
                                  "the lengths count 4 ids \\('user': 1, 'friend': 2, 'item': 1\\) but the batch "
                                  "holds 3 values"),
    "negative length": (["user", "friend", "item"], [1, 2, 3], [2, -1, 2],
                        "feature 'friend' of table 'users': negative length -1"),
    "lengths not one per sample": (["user", "friend", "item"], [1, 2, 3], [1, 1, 1, 0],
                                   "4 lengths, not one per sample of each feature"),
}


def _kjt(keys: list[str], values: list[int], lengths: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=keys, values=torch.tensor(values), lengths=torch.tensor(lengths, dtype=torch.int32))


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_batch_is_refused_naming_the_feature_the_table_and_the_value(case: str) -> None:
    keys, values, lengths, message = MALFORMED[case]
    with pytest.raises(ValueError, match=f"^batch refused: {message}"):
        BatchCheck(TABLES)(_kjt(keys, values, lengths))


def test_a_well_formed_batch_passes_in_any_key_order_with_empty_bags() -> None:
    check = BatchCheck(TABLES)
    check(_kjt(["item", "user", "friend"], [4, 0, 9, 9], [1, 0, 1, 0, 2, 0]))
    check(_kjt(["user", "friend", "item"], [], [0, 0, 0]))


DMP_CASES = {  # over tests/tiny_dmp.py: tables t0, t1 of 50 rows, one feature each, named as the table
    "unknown key": ("tx", None, "unknown feature 'tx'"),
    "negative id": ("t1", -3, "feature 't1' of table 't1': id -3 out of range \\[0, 50\\)"),
    "id beyond the table": ("t0", 50, "feature 't0' of table 't0': id 50 out of range \\[0, 50\\)"),
    "lengths beyond the values": ("t0", "extra length", "the lengths count 33 ids"),
}


def _bad_batch(trainer: int, case: str) -> Any:
    """tiny_dmp's batch of this trainer, spoiled as DMP_CASES says."""
    from torchrec.datasets.utils import Batch

    from tests import tiny_dmp

    feature, value, _ = DMP_CASES[case]
    good = tiny_dmp.batch(trainer, 0)
    keys = list(good.sparse_features.keys())
    values, lengths = good.sparse_features.values().clone(), good.sparse_features.lengths().clone()
    if value is None:
        keys[1] = feature
    elif value == "extra length":
        lengths[0] += 1
    else:
        values[keys.index(feature) * tiny_dmp.BATCH + 3] = value
    features = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)
    return Batch(dense_features=good.dense_features, sparse_features=features, labels=good.labels)


def malformed_on_one_trainer(rank: int, world_size: int) -> dict[str, Any] | None:
    """2 trainers + 1 server: a good step, then each malformed batch on one trainer only (the other
    enters no collective meanwhile, so the refusal must come before TorchRec's all-to-all), then a
    good step again on both."""
    import torch.distributed as dist

    import shadowgba
    from shadowgba.config import SyncConfig, from_dict
    from shadowgba.integrations.torchrec import _CheckedInputDist, check_batches
    from tests import tiny_dmp

    job = shadowgba.join(from_dict(SyncConfig, {"algo": "gba", "ps": {"num_servers": 1}}))
    if job.is_server:
        return None
    try:
        model, _ = tiny_dmp.build(dmp_kwargs=job.dmp_kwargs())
        sharded = [module for module in model.modules() if isinstance(module.__dict__.get("input_dist"), _CheckedInputDist)]
        out: dict[str, Any] = {"installed": len(sharded), "again": check_batches(model),
                               "wrapped_once": not isinstance(sharded[0].input_dist.input_dist, _CheckedInputDist)}
        trainer = job.trainer_index
        model(tiny_dmp.batch(trainer, 0))[0].backward()
        out["refused"] = {}
        for number, case in enumerate(DMP_CASES):
            if number % 2 == trainer:
                try:
                    model(_bad_batch(trainer, case))
                    out["refused"][case] = None
                except ValueError as error:
                    out["refused"][case] = str(error)
            dist.barrier(group=job.trainer_group)
        loss, _ = model(tiny_dmp.batch(trainer, 1))
        loss.backward()
        out["after"] = loss.item()
        return out
    finally:
        job.close()


def assert_refused_by_the_trainer_that_got_it(results: list[Any]) -> None:
    """`malformed_on_one_trainer`'s per-rank results: each trainer refused its own malformed batches,
    with the message of each case, and both still trained afterwards."""
    assert results[2] is None  # the server
    for trainer, out in enumerate(results[:2]):
        assert out["installed"] == 1 and out["again"] == 1 and out["wrapped_once"]  # by ShardingGuard, once
        mine = {case for number, case in enumerate(DMP_CASES) if number % 2 == trainer}
        assert set(out["refused"]) == mine
        for case in mine:
            message = out["refused"][case]
            assert message is not None and message.startswith("batch refused: "), (case, message)
            assert re.search(DMP_CASES[case][2], message), (case, message)
        assert torch.isfinite(torch.tensor(out["after"]))  # the DMP still trains after the refusals
