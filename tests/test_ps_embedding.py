"""Embeddings on the PS: the shard's update rules in-process, and the module against TorchRec on real ranks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from shadowgba.errors import PeerLost, SyncError
import torch.distributed as dist
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from shadowgba.config import ConfigError
from shadowgba.nonfinite import NonFiniteGuard
from shadowgba.ps.transport import Transport
from shadowgba.ps.start import start_transport
from shadowgba.ps.embedding import PSEmbeddingBagCollection
from shadowgba.ps.embedding_shard import EmbeddingShard, PSEmbeddingConfig, checked_tables
from sync_algos.staleness import StalenessDecayConfig
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(120)

LR = 0.1
BATCH = 3
TABLES = [
    EmbeddingBagConfig(name="users", num_embeddings=10, embedding_dim=4, feature_names=["user"]),
    EmbeddingBagConfig(name="products", num_embeddings=7, embedding_dim=3, feature_names=["item", "history"],
                       pooling=PoolingType.MEAN),
]
"""One sum-pooled table, one mean-pooled table read by two features; the rows spread over both servers."""
BAGS = [  # per trainer, per feature: one bag of ids per sample; empty bags and repeated ids included
    {"user": [[1, 4], [], [9]], "item": [[0], [6, 2, 2], []], "history": [[], [], []]},
    {"user": [[], [3, 1, 1], [8]], "item": [[5], [], [1, 3]], "history": [[2], [0, 6], []]},
]


def batch(trainer: int) -> KeyedJaggedTensor:
    bags = BAGS[trainer]
    keys = list(bags)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.tensor([i for key in keys for bag in bags[key] for i in bag], dtype=torch.int64),
        lengths=torch.tensor([len(bag) for key in keys for bag in bags[key]], dtype=torch.int32),
    )


def probe(trainer: int) -> torch.Tensor:
    """Fixed output weights: loss = sum(pooled * probe) gives every pooled value its own gradient."""
    return torch.randn(BATCH, 4 + 3 + 3, generator=torch.Generator().manual_seed(100 + trainer))


def reference() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(TABLES)


def tables_of(ebc: EmbeddingBagCollection) -> dict[str, torch.Tensor]:
    return {name: bag.weight.detach().clone() for name, bag in ebc.embedding_bags.items()}


SERVICES = {
    "hogwild": PSEmbeddingConfig(lr=LR),
    "gba": PSEmbeddingConfig(lr=LR, mode="aggregate", global_batch=2 * BATCH),
}
"""Two services on every server: asynchronous SGD, and GBA over the global batch of both trainers."""


def ps_against_torchrec(rank: int, world_size: int) -> dict:
    """Ranks 0-1 train, 2-3 serve. One step of both trainers on both services, then refused pushes."""
    ps = start_transport(num_servers=2)
    roles = ps.roles
    try:
        if roles.is_server:
            for name, config in SERVICES.items():
                ps.serve(name, EmbeddingShard(TABLES, config, roles.server_index, roles.num_servers))
            return {}
        return train_one_step(ps)
    finally:
        ps.stop()


def train_one_step(ps: Transport) -> dict:
    roles = ps.roles
    me = roles.trainer_index
    ebc = reference()
    initial = tables_of(ebc)
    modules = {
        name: PSEmbeddingBagCollection(TABLES, config, ps, service=name)
        for name, config in SERVICES.items()
    }
    if me == 0:
        for module in modules.values():
            for name, weight in initial.items():
                module.load_table(name, weight)
    dist.barrier(group=roles.trainer_group)
    expected = ebc(batch(me))
    for module in modules.values():
        pooled = module(batch(me))
        assert pooled.keys() == expected.keys() == ["user", "item", "history"]
        assert pooled.length_per_key() == expected.length_per_key()
        torch.testing.assert_close(pooled.values(), expected.values(), rtol=0, atol=1e-6)
        (pooled.values() * probe(me)).sum().backward()
    dist.barrier(group=roles.trainer_group)  # both trainers' gradients come from the initial rows
    for module in modules.values():
        module.push_gradients()
        module.flush()
    dist.barrier(group=roles.trainer_group)  # both trainers' pushes are applied
    sum(((ebc(batch(t)).values() * probe(t)).sum() for t in range(2)), torch.tensor(0.0)).backward()
    gradients = {name: bag.weight.grad for name, bag in ebc.embedding_bags.items()}
    for name, weight in initial.items():
        # hogwild: each trainer's step applied; GBA: one step with the mean over the global batch
        hogwild, gba = modules["hogwild"].read_table(name), modules["gba"].read_table(name)
        torch.testing.assert_close(hogwild, weight - LR * gradients[name], rtol=0, atol=1e-6)
        torch.testing.assert_close(gba, weight - LR * gradients[name] / 2, rtol=0, atol=1e-6)
    dist.barrier(group=roles.trainer_group)
    if me == 0:
        check_refusals(modules["hogwild"])
    dist.barrier(group=roles.trainer_group)
    return {name: [ps.call(server, name, "stats") for server in range(roles.num_servers)] for name in SERVICES}


def check_refusals(module: PSEmbeddingBagCollection) -> None:
    """A malformed push is refused; NaN gradients from the module (marked, no rows sent, its
    guard told) and NaN rows pushed as they are (found by the shard) are dropped (on_nonfinite skip,
    counted by the shards); nothing changes."""
    before = {name: module.read_table(name) for name in ("users", "products")}
    float64_rows = {"users": (torch.tensor([0, 2]), torch.ones(2, 4, dtype=torch.float64))}
    with pytest.raises(ValueError, match=r"push refused: table 'users': rows must be a torch.float32 tensor"):
        module.transport.call(0, "hogwild", "push", float64_rows, 1)
    with pytest.raises(ValueError, match="push refused: table 'users': id 3 belongs to server 1, not 0"):
        module.transport.call(0, "hogwild", "push", {"users": (torch.tensor([3]), torch.ones(1, 4))}, 1)
    pooled = module(batch(0))
    (pooled.values() * math.nan).sum().backward()
    module.guard = NonFiniteGuard("trainer 0 (rank 0)")
    module.push_gradients()
    module.flush()  # dropped and counted by every server, not refused: the trainer carries on
    assert module.guard.caught == "row gradients of PS-hosted tables"
    module.transport.call(0, "hogwild", "push", {"users": (torch.tensor([0]), torch.full((1, 4), math.nan))}, 1, None, 0)
    with pytest.raises(ValueError, match=r"lookup refused: table 'users': id 10 out of range \[0, 10\)"):
        module(KeyedJaggedTensor.from_lengths_sync(
            keys=["user", "item", "history"], values=torch.tensor([10]), lengths=torch.tensor([1, 0, 0])
        ))
    for name, weight in before.items():
        torch.testing.assert_close(module.read_table(name), weight, rtol=0, atol=0)
    module(batch(0)).values().sum().backward()
    with pytest.raises(RuntimeError, match="call push_gradients"):
        module(batch(0))


def test_ps_module_matches_torchrec_forward_and_one_step_with_two_trainers_and_two_servers() -> None:
    stats = run_ranks(ps_against_torchrec, 4, timeout_s=90)[0]
    for server, shard in enumerate(stats["hogwild"]):  # one push per trainer per server, the refused ones not
        dropped = 2 if server == 0 else 1  # counted, the NaN ones counted and dropped (server 0 got two)
        assert (shard["pushes"], shard["updates"], shard["pending_rows"]) == (2 + dropped, 2, 0)
        assert (shard["nonfinite_dropped"], shard["failure"]) == (dropped, None)
    for shard in stats["gba"]:
        assert (shard["pushes"], shard["updates"], shard["pending_samples"]) == (2, 1, 0)


def shard(config: PSEmbeddingConfig, server_index: int = 0, num_servers: int = 1) -> EmbeddingShard:
    """A shard of table "t" (10 x 2) with weight[i] = (i, -i) on its rows."""
    table = EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=2)
    built = EmbeddingShard([table], config, server_index, num_servers)
    ids = torch.arange(server_index, 10, num_servers)
    built.load_rows({"t": (ids, torch.stack([ids, -ids], dim=1).float())})
    return built


def rows(built: EmbeddingShard, ids: list[int]) -> torch.Tensor:
    return built.lookup({"t": torch.tensor(ids)})["t"]


def test_hogwild_sgd_sums_repeated_ids_and_serves_only_its_own_rows() -> None:
    built = shard(PSEmbeddingConfig(lr=0.5), server_index=1, num_servers=2)
    grads = torch.tensor([[1.0, 2.0], [4.0, 8.0], [16.0, 32.0]])
    built.push({"t": (torch.tensor([3, 1, 3]), grads)}, 3)
    expected = torch.tensor([[1.0, -1.0], [3.0, -3.0]]) - 0.5 * torch.stack([grads[1], grads[0] + grads[2]])
    torch.testing.assert_close(rows(built, [1, 3]), expected)
    assert built.stats() == {
        "pushes": 1, "updates": 1, "rows_applied": 2, "pending_rows": 0, "pending_samples": 0,
        "nonfinite_dropped": 0, "restored_at": None, "dropped_after_restore": 0,
        "failure": None, "decayed": 0, "dropped": 0, "staleness_histogram": {},  # hogwild: no tokens
    }


def test_rowwise_adagrad_follows_its_formula_over_two_steps() -> None:
    config = PSEmbeddingConfig(optimizer="rowwise_adagrad", lr=0.1, eps=1e-3)
    built = shard(config)
    first, second = torch.tensor([[3.0, -1.0]]), torch.tensor([[0.5, 2.0]])
    built.push({"t": (torch.tensor([4]), first)}, 1)
    accumulator = (first**2).mean()
    weight = torch.tensor([4.0, -4.0]) - 0.1 * first[0] / (accumulator.sqrt() + 1e-3)
    torch.testing.assert_close(rows(built, [4])[0], weight)
    built.push({"t": (torch.tensor([4]), second)}, 1)
    accumulator = accumulator + (second**2).mean()
    torch.testing.assert_close(rows(built, [4])[0], weight - 0.1 * second[0] / (accumulator.sqrt() + 1e-3))


def test_aggregate_mode_applies_the_sample_weighted_mean_once_a_global_batch_has_arrived() -> None:
    built = shard(PSEmbeddingConfig(lr=0.5, mode="aggregate", global_batch=8))
    initial = rows(built, list(range(10)))
    first, second = torch.tensor([[1.0, 1.0], [2.0, 2.0]]), torch.tensor([[4.0, 4.0], [8.0, 8.0]])
    built.push({"t": (torch.tensor([1, 2]), first)}, 4, 0)
    torch.testing.assert_close(rows(built, list(range(10))), initial)  # nothing applied yet
    assert built.stats() | {"rows_applied": None} == {
        "pushes": 1, "updates": 0, "rows_applied": None, "pending_rows": 2, "pending_samples": 4,
        "nonfinite_dropped": 0, "restored_at": None, "dropped_after_restore": 0,
        "failure": None, "decayed": 0, "dropped": 0, "staleness_histogram": {"0": 1},
    }
    built.push({"t": (torch.tensor([2, 5]), second)}, 4, 0)  # equal batches: the mean of the two pushes
    expected = initial.clone()
    expected[[1, 2, 5]] -= 0.5 * torch.stack([first[0], first[1] + second[0], second[1]]) / 2
    torch.testing.assert_close(rows(built, list(range(10))), expected)
    assert built.stats() == {
        "pushes": 2, "updates": 1, "rows_applied": 3, "pending_rows": 0, "pending_samples": 0,
        "nonfinite_dropped": 0, "restored_at": None, "dropped_after_restore": 0,
        "failure": None, "decayed": 0, "dropped": 0, "staleness_histogram": {"0": 2},
    }
    built.push({"t": (torch.tensor([7]), first[:1])}, 2, 1)  # unequal batches: weighted by samples
    built.push({"t": (torch.tensor([7]), second[:1])}, 6, 1)
    expected[7] -= 0.5 * (2 * first[0] + 6 * second[0]) / 8
    torch.testing.assert_close(rows(built, [7])[0], expected[7])


MALFORMED = {
    "unknown table": ({"nope": (torch.tensor([1]), torch.ones(1, 2))}, 1, "unknown table 'nope'; tables: \\['t'\\]"),
    "id out of range": ({"t": (torch.tensor([4, 10]), torch.ones(2, 2))}, 1, "id 10 out of range \\[0, 10\\)"),
    "negative id": ({"t": (torch.tensor([-2]), torch.ones(1, 2))}, 1, "id -2 out of range"),
    "2-D ids": ({"t": (torch.tensor([[2]]), torch.ones(1, 2))}, 1, "ids must be a 1-D int32/int64 tensor"),
    "float ids": ({"t": (torch.tensor([2.0]), torch.ones(1, 2))}, 1, "ids must be a 1-D int32/int64 tensor"),
    "float64 rows": ({"t": (torch.tensor([2]), torch.ones(1, 2).double())}, 1, "rows must be a torch.float32 tensor"),
    "wrong width": ({"t": (torch.tensor([2]), torch.ones(1, 3))}, 1, "shape \\(1, 2\\), got .* shape \\(1, 3\\)"),
    "too few rows": ({"t": (torch.tensor([2, 4]), torch.ones(1, 2))}, 1, "shape \\(2, 2\\)"),
    "not a pair": ({"t": torch.tensor([2])}, 1, "expected \\(ids, rows\\)"),
    "no samples": ({"t": (torch.tensor([2]), torch.ones(1, 2))}, 0, "num_samples must be an integer >= 1"),
    "token from the future": ({"t": (torch.tensor([2]), torch.ones(1, 2))}, 1, "token 1 is from the future"),
    "negative token": ({"t": (torch.tensor([2]), torch.ones(1, 2))}, 1, "token must be >= 0, got -1"),
    "no token": ({"t": (torch.tensor([2]), torch.ones(1, 2))}, 1, "aggregate mode needs the lookup's token"),
    "one bad table of two": (
        {"t": (torch.tensor([2]), torch.ones(1, 2)), "u": (torch.tensor([1]), torch.ones(1, 2))}, 1, "unknown table 'u'"
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_malformed_pushes_are_refused_and_leave_the_shard_untouched(case: str, optimizer: str) -> None:
    built = shard(PSEmbeddingConfig(optimizer=optimizer, mode="aggregate", global_batch=2))
    built.push({"t": (torch.tensor([2]), torch.ones(1, 2))}, 1, 0)  # something pending, too
    weights, stats = rows(built, list(range(10))), built.stats()
    request, num_samples, message = MALFORMED[case]
    token = {"token from the future": 1, "negative token": -1, "no token": None}.get(case, 0)
    with pytest.raises(ValueError, match=f"push refused: .*{message}"):
        built.push(request, num_samples, token)
    torch.testing.assert_close(rows(built, list(range(10))), weights, rtol=0, atol=0)
    assert built.stats() == stats


def test_non_finite_row_pushes_are_dropped_and_counted_under_skip_and_end_the_job_under_fail() -> None:
    """Marked by the trainer (no rows sent) or found by the shard, a NaN / Inf push changes no row and
    counts no sample (every shard drops a marked push alike); under fail it is refused naming the
    trainer, and so is every later push, any trainer's."""
    inf_rows = {"t": (torch.tensor([2]), torch.tensor([[1.0, math.inf]]))}
    skipping = shard(PSEmbeddingConfig(mode="aggregate", global_batch=2))
    weights = rows(skipping, list(range(10)))
    skipping.push(inf_rows, 1, 0, 1)
    skipping.push({}, 1, 0, 1, finite=False)
    torch.testing.assert_close(rows(skipping, list(range(10))), weights, rtol=0, atol=0)
    stats = skipping.stats()
    assert (stats["pushes"], stats["nonfinite_dropped"], stats["pending_samples"], stats["updates"]) == (2, 2, 0, 0)
    failing = shard(PSEmbeddingConfig(on_nonfinite="fail"))
    with pytest.raises(SyncError, match=r"push refused: trainer 1's row gradients have NaN or inf values "
                                         r"\(sync.on_nonfinite: fail\)"):
        failing.push(inf_rows, 1, None, 1)
    with pytest.raises(PeerLost, match="push refused: the job failed: trainer 1's row gradients") as refused:
        failing.push({"t": (torch.tensor([2]), torch.ones(1, 2))}, 1, None, 0)
    assert refused.value.ranks == (1,)  # the refusal names the rank, so trainer 0 never blames itself
    assert failing.stats()["failure"] == "trainer 1's row gradients have NaN or inf values (sync.on_nonfinite: fail)"
    with pytest.raises(ValueError, match="load refused: table 't': rows contain NaN or infinity"):
        failing.load_rows(inf_rows)  # loading never takes them, whatever on_nonfinite says


def test_aggregate_mode_decays_or_drops_stale_row_gradients_as_the_dense_gba_shards_do() -> None:
    """Global batch of 2 one-sample pushes; every lookup's token is the shard's global step k."""
    decay = StalenessDecayConfig(kind="exponential", threshold=1, rate=0.5, max_staleness=2)
    built = shard(PSEmbeddingConfig(lr=1.0, mode="aggregate", global_batch=2, decay=decay))
    gradient = torch.tensor([[4.0, 8.0]])
    _, old = built.lookup_with_token({"t": torch.tensor([3])})
    assert old == 0
    for _ in range(2):  # k = 2 after two global batches on row 1
        built.push({"t": (torch.tensor([1]), gradient)}, 1, built.lookup_with_token({"t": torch.tensor([1])})[1])
        built.push({"t": (torch.tensor([1]), gradient)}, 1, built.lookup_with_token({"t": torch.tensor([1])})[1])
    before = rows(built, list(range(10)))
    built.push({"t": (torch.tensor([3]), gradient)}, 1, 1)  # staleness 1: full weight
    built.push({"t": (torch.tensor([3]), gradient)}, 1, 0)  # staleness 2: weight 0.5, fills the batch
    expected = before.clone()
    expected[3] -= (gradient[0] + 0.5 * gradient[0]) / 2
    torch.testing.assert_close(rows(built, list(range(10))), expected)
    built.push({"t": (torch.tensor([5]), gradient)}, 1, old)  # staleness 3 > max_staleness: dropped
    assert rows(built, [5])[0].tolist() == expected[5].tolist()
    stats = built.stats()
    assert (stats["updates"], stats["decayed"], stats["dropped"], stats["pending_samples"]) == (3, 1, 1, 0)
    assert stats["staleness_histogram"] == {"0": 4, "1": 1, "2": 1, "3": 1}
    assert stats["pending_rows"] == 0  # the dropped push left nothing in the buffer
    hogwild = shard(PSEmbeddingConfig(lr=1.0, decay=decay))  # no global step: tokens are ignored
    hogwild.push({"t": (torch.tensor([5]), gradient)}, 1)
    assert hogwild.stats()["dropped"] == 0


def test_gba_rows_count_fully_when_stale_by_default_and_row_decay_overrides_it() -> None:
    """`sync.gba.row_decay` (default: full weight up to max_staleness) weighs the rows' pushes,
    `sync.gba.decay` (default: halved per step) only the dense ones. The default was chosen by the
    small preset at 2M samples, seed 0: GBA - sync -0.0100 (median of 7 runs) with the rows halved
    as the dense gradients, -0.0021 (median of 6) with them counted fully (docs/gba.md, "The rows' decay")."""
    from shadowgba import ps_table_options
    from shadowgba.config import SyncConfig, from_dict

    config = from_dict(SyncConfig, {"algo": "gba", "ps": {"num_servers": 1}})
    options = ps_table_options(config, num_trainers=2, local_batch_size=1)
    assert (options.mode, options.decay.kind, options.decay.max_staleness) == ("aggregate", "none", 32)
    assert (config.gba.decay.kind, config.gba.decay.rate, config.gba.decay.threshold) == ("exponential", 0.5, 0)
    built = shard(dataclasses.replace(options, lr=1.0))
    gradient = torch.tensor([[4.0, 8.0]])
    built.push({"t": (torch.tensor([1]), gradient)}, 1, 0)
    built.push({"t": (torch.tensor([1]), gradient)}, 1, 0)  # k = 1
    before = rows(built, [3])
    built.push({"t": (torch.tensor([3]), gradient)}, 1, 0)  # staleness 1: full weight
    built.push({"t": (torch.tensor([3]), gradient)}, 1, 1)
    torch.testing.assert_close(rows(built, [3]), before - gradient)
    assert built.stats()["decayed"] == 0
    halved = from_dict(SyncConfig, {"algo": "gba", "ps": {"num_servers": 1}, "gba": {"row_decay": {"kind": "exponential"}}})
    overridden = ps_table_options(halved, 2, 1).decay
    assert (overridden.kind, overridden.rate) == ("exponential", 0.5)


def test_lookups_of_foreign_or_unknown_rows_are_refused() -> None:
    built = shard(PSEmbeddingConfig(), server_index=0, num_servers=3)
    with pytest.raises(ValueError, match="lookup refused: table 't': id 4 belongs to server 1, not 0"):
        built.lookup({"t": torch.tensor([3, 4])})
    with pytest.raises(ValueError, match="lookup refused: unknown table 'u'"):
        built.lookup({"u": torch.tensor([0])})


def test_initial_rows_are_seeded_per_table_and_server_and_leave_the_global_rng_alone() -> None:
    table = EmbeddingBagConfig(name="t", num_embeddings=100, embedding_dim=8)

    def initial(seed: int, server_index: int) -> torch.Tensor:
        built = EmbeddingShard([table], PSEmbeddingConfig(seed=seed), server_index, 2)
        return built.lookup({"t": torch.arange(server_index, 100, 2)})["t"]

    torch.manual_seed(5)
    state = torch.get_rng_state()
    assert torch.equal(initial(0, 0), initial(0, 0))
    assert not torch.equal(initial(0, 0), initial(0, 1)) and not torch.equal(initial(0, 0), initial(1, 0))
    assert initial(0, 1).abs().max() <= math.sqrt(1 / 100)  # TorchRec's default init range
    assert torch.equal(torch.get_rng_state(), state)


def test_bad_configs_and_tables_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="global_batch must be >= 1 sample in aggregate mode"):
        PSEmbeddingConfig(mode="aggregate")
    with pytest.raises(ConfigError, match="max_in_flight must be >= 1"):
        PSEmbeddingConfig(max_in_flight=0)
    table = EmbeddingBagConfig(name="t", num_embeddings=4, embedding_dim=2)
    with pytest.raises(ValueError, match="distinct, non-empty names"):
        checked_tables([table, table])
    with pytest.raises(ValueError, match="only FP32 tables"):
        checked_tables([EmbeddingBagConfig(name="h", num_embeddings=4, embedding_dim=2, data_type=DataType.FP16)])
    with pytest.raises(ValueError, match="Unsupported pooling type"):
        checked_tables([EmbeddingBagConfig(name="n", num_embeddings=4, embedding_dim=2, pooling=PoolingType.NONE)])
    assert checked_tables([table])[0].feature_names == ["t"] and table.feature_names == []
