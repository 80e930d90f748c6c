"""The metrics' standard sinks (`shadowgba.reporting`), the first-batch check of `local_batch_size`
(`shadowgba.batch_size`) and the optional dependencies' errors (`shadowgba.optional`), in one process.
Their wiring into both runtimes runs in the multi-rank jobs of test_factory.py (GBA, a writer of the
user's) and test_torchrec_and_hogwild.py (the shadow runtime, TensorBoard through sync.tensorboard_dir)."""

from __future__ import annotations

import dataclasses
import logging
import sys

import pytest
import torch
from torch import nn

from shadowgba import SetupError, optional, reporting
from shadowgba.batch_size import batch_size_of, check_first_batch
from shadowgba.metrics import SyncMetrics
from shadowgba.reporting import MetricsReporter


class RecordingWriter:
    """What the reporter needs of TensorBoard's `SummaryWriter`, recording the calls."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.flushed = self.closed = 0

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.scalars.append((tag, value, global_step))

    def flush(self) -> None:
        self.flushed += 1

    def close(self) -> None:
        self.closed += 1


def capture_logs(level: int = logging.INFO) -> list[logging.LogRecord]:
    """The `shadowgba` logger's records at `level` and above from now on, in this process (a rank)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("shadowgba")
    logger.addHandler(handler)
    logger.setLevel(min(logger.getEffectiveLevel(), level))
    return records


def test_the_reporter_logs_and_writes_scalars_when_its_interval_is_due_and_once_more_at_close(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr(reporting.time, "monotonic", lambda: clock[0])
    metrics, writer = SyncMetrics(), RecordingWriter()
    reporter = MetricsReporter(metrics, interval_s=5.0, writer=writer, owns_writer=True)
    caplog.set_level(logging.INFO, logger="shadowgba")
    for _ in range(3):
        metrics.record_step(0.0)
        reporter.on_step()
    assert not caplog.records and not writer.scalars  # not due yet
    clock[0] = 105.0
    reporter.on_step()
    reporter.on_step()  # the next report is due 5 s later
    assert [record.getMessage()[:24] for record in caplog.records] == ["shadowgba: rounds=0 (0.0"]
    assert ("shadowgba/steps", 3, 3) in writer.scalars and ("shadowgba/rounds", 0, 3) in writer.scalars
    reported = len(writer.scalars)
    metrics.record_step(0.0)
    reporter.close()
    reporter.close()
    assert ("shadowgba/steps", 4, 4) in writer.scalars[reported:]
    assert len(writer.scalars) == 2 * reported and (writer.flushed, writer.closed) == (1, 1)


def test_a_reporter_with_interval_zero_never_logs_and_leaves_a_user_s_writer_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    writer = RecordingWriter()
    reporter = MetricsReporter(SyncMetrics(), interval_s=0.0, writer=writer)
    caplog.set_level(logging.INFO, logger="shadowgba")
    reporter.on_step()
    reporter.close()
    assert not caplog.records
    assert writer.scalars and (writer.flushed, writer.closed) == (1, 0)


def test_a_tensorboard_dir_without_tensorboard_names_what_to_install(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    with pytest.raises(SetupError, match=r"sync\.tensorboard_dir needs tensorboard.*pip install 'shadowgba\[tensorboard\]'"):
        reporting.summary_writer(tmp_path, trainer_index=0)


def test_a_missing_torchrec_is_a_setup_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchrec", None)  # as if it were not installed
    assert not optional.available("torchrec")
    with pytest.raises(SetupError, match=r"Job\.ps_embeddings\(\) needs torchrec.*pip install 'shadowgba\[torchrec\]'"):
        optional.ps_embedding("Job.ps_embeddings()")


@dataclasses.dataclass
class Batch:
    """TorchRec's `Batch` layout: tensors (and a KJT) as fields."""

    dense_features: torch.Tensor
    labels: torch.Tensor


class Jagged:
    """A `KeyedJaggedTensor`'s batch size: `stride()`."""

    def stride(self) -> int:
        return 7


def test_the_batch_size_is_read_from_tensors_jagged_tensors_and_batches() -> None:
    assert batch_size_of(torch.zeros(5, 3)) == 5
    assert batch_size_of(Jagged()) == 7
    assert batch_size_of(Batch(torch.zeros(9, 2), torch.zeros(9))) == 9
    assert batch_size_of(torch.tensor(1.0)) is None and batch_size_of("text") is None


def test_a_first_batch_of_another_size_than_local_batch_size_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Linear(4, 1)
    check_first_batch(model, local_batch_size=64)
    caplog.set_level(logging.WARNING, logger="shadowgba")
    model(torch.zeros(32, 4))
    model(torch.zeros(16, 4))  # the hook is gone after the first forward
    (record,) = caplog.records
    assert "local_batch_size=64), but the first batch this trainer's model ran on holds 32 samples" in record.getMessage()
    caplog.clear()
    check_first_batch(model, local_batch_size=32)
    model(input=torch.zeros(32, 4))
    assert not caplog.records and not model._forward_pre_hooks
