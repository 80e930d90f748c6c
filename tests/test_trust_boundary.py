"""What a process that can write a checkpoint folder, reach a server's session or write the job's
store can no longer do: run code in a shadowgba process (docs/design.md, "Trust boundary").

Every crafted input carries a live payload (checked: an unrestricted unpickler runs it) that would
create a marker file; each test asserts the input is refused with an error naming where it came
from, that the marker does not exist, and that the process goes on: a real checkpoint still
loads, the server still answers a legitimate trainer and the acceptor still takes its sessions.
The wire and store cases share one 2-rank transport job (trainer rank 0, server rank 1).
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(120)


class _Touch:
    """A payload: unpickling it opens (creates) `marker` for writing; no shell, nothing else."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (str(self.marker), "w")


def _live(payload: bytes, marker: Path, load: Any) -> None:
    """Check that `load(payload)` (an unrestricted unpickler) runs the payload, then remove its marker."""
    try:
        load(payload)
    except Exception:  # noqa: BLE001 (the payload ran; what it built is no valid object)
        pass
    assert marker.exists(), "the crafted payload is not live"
    marker.unlink()


def _reseal(folder: Path) -> None:
    """Recompute `shadowgba.json`'s size and CRC-32 of every file, as anyone who can write the folder can."""
    manifest_path = folder / "shadowgba.json"
    manifest = json.loads(manifest_path.read_text())
    for name in manifest["files"]:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "crc32": zlib.crc32(data)}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")


def _crafted_checkpoints(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Save a real checkpoint; load it with a crafted `.metadata`, then with a crafted bytes item
    in a `.distcp` (each resealed); then load the real one again."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from shadowgba.checkpoint import Checkpointer, PerTrainer, Setup, TrainState
    from shadowgba.errors import CheckpointError

    marker = Path(root, "ran")
    model = torch.nn.Linear(4, 3)
    checkpointer = Checkpointer(Path(root, "ckpt"), Setup.of("ma", model.named_parameters(), 1, 0),
                                process_group=dist.group.WORLD)
    train = TrainState(0, step=5)
    state = {"model": PerTrainer(model, 0), "train": train}
    checkpointer.save(5, state)
    folder = checkpointer.path_of(5)
    metadata_file = folder / ".metadata"
    original = metadata_file.read_bytes()
    out: dict[str, Any] = {}

    def load() -> str:
        train.step = 0
        try:
            checkpointer.load(folder, state)
        except CheckpointError as error:
            return str(error)
        return f"loaded step {train.step}"

    # a .metadata whose planner data carries the payload: pickle.load, as DCP reads it, runs it
    metadata = pickle.loads(original)
    metadata.planner_data = {"payload": _Touch(marker)}
    crafted = pickle.dumps(metadata)
    _live(crafted, marker, pickle.loads)
    metadata_file.write_bytes(crafted)
    _reseal(folder)
    out["metadata"] = load(), marker.exists()

    # a bytes item (trainer 0's TrainState) pointing at a payload appended to its .distcp
    metadata = pickle.loads(original)
    [info] = [info for index, info in metadata.storage_data.items() if index.fqn == "train.trainer0"]
    assert isinstance(metadata.state_dict_metadata["train.trainer0"], BytesStorageMetadata)
    data_file = folder / info.relative_path
    payload = io.BytesIO()
    torch.save(_Touch(marker), payload)
    _live(payload.getvalue(), marker, lambda blob: torch.load(io.BytesIO(blob), weights_only=False))
    info.offset, info.length = data_file.stat().st_size, len(payload.getvalue())
    with open(data_file, "ab") as appended:
        appended.write(payload.getvalue())
    metadata_file.write_bytes(pickle.dumps(metadata))
    _reseal(folder)
    out["item"] = load(), marker.exists(), info.relative_path

    metadata_file.write_bytes(original)  # the real item again (the appended bytes are never read)
    _reseal(folder)
    out["real"] = load()
    return out


def test_a_crafted_checkpoint_is_refused_naming_its_file_and_runs_nothing(tmp_path: Path) -> None:
    """DCP reads `.metadata` with pickle.load and bytes items with torch.load(weights_only=False):
    through shadowgba's reader a crafted one, with the seal recomputed, is refused instead."""
    [out] = run_ranks(_crafted_checkpoints, 1, str(tmp_path), timeout_s=60)
    message, ran = out["metadata"]
    assert not ran and not (tmp_path / "ran").exists()
    assert "step_00000005/.metadata is refused: it names io.open, which no DCP metadata holds" in message, message
    message, ran, data_file = out["item"]
    assert not ran, message
    assert f"step_00000005/{data_file} is refused" in message and "checkpoint entry 'train.trainer0' holds an " \
        "object other than tensors" in message, message
    assert out["real"] == "loaded step 5", out["real"]


FRAME_WORDS = struct.Struct("<8q")
"""The new wire's frame words (`shadowgba.ps.wire`); the old one had 6, without magic and version."""


def _frame(kind: int, header: bytes, count: int = 0, words: int = 8) -> torch.Tensor:
    from shadowgba.ps import wire

    head = FRAME_WORDS.pack(wire.MAGIC, wire.WIRE_VERSION, kind, len(header), count, -1, 0, 0) if words == 8 else \
        struct.pack("<6q", kind, len(header), count, -1, 0, 0)  # the pickled wire's frame
    return torch.frombuffer(bytearray(head + header), dtype=torch.uint8)


def _impostor(ps: Any, frame: torch.Tensor) -> bool:
    """Open a raw session with server 0 as trainer 0, send `frame`, and wait for the server's CLOSE."""
    from shadowgba.ps import sessions, wire

    store, generation, server = ps._store, ps._generation, ps._server_incarnations[0]
    info = sessions.request_session(store, generation, 0, server, 0, ps.roles.rank, 10.0, 10.0, ps.incarnation)
    group, _ = sessions.session_group(ps._namespace, generation, 0, server, info.ticket, 1, 10.0)
    group.send([frame], 0, 0).wait()
    buffer = torch.empty(wire.FRAME_BYTES, dtype=torch.uint8)
    for _ in range(4):  # a lane offer may come first
        group.recv([buffer], 0, 0).wait()
        if FRAME_WORDS.unpack_from(wire.as_bytes(buffer))[2] == wire.CLOSE:
            return True
    return False


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Echo:
    def double(self, values: torch.Tensor) -> torch.Tensor:
        return values * 2


def _crafted_wire_and_store(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Trainer: a real call; crafted joins in the store; impostor sessions sending crafted frames;
    a real call again. Server: serves, and reports what it logged."""
    from shadowgba.ps import sessions, wire
    from shadowgba.ps.codec import to_json
    from shadowgba.ps.start import start_transport

    marker = Path(root, "ran")
    warnings = _Warnings()
    logging.getLogger("shadowgba").addHandler(warnings)
    ps = start_transport(num_servers=1)
    out: dict[str, Any] = {}
    try:
        if ps.roles.is_server:
            ps.serve("echo", Echo())
            return out
        out["before"] = ps.call(0, "echo", "double", torch.ones(2)).tolist()
        server = ps._server_incarnations[0]

        def key(name: str) -> str:
            return sessions.server_key(ps._generation, 0, server, name)

        # the store: a pickled join, and a JSON join naming another ticket
        joins = [pickle.dumps(_Touch(marker)), to_json(sessions.SessionInfo(99, 0, rank, 10.0))]
        _live(joins[0], marker, pickle.loads)
        out["joins"] = []
        for join in joins:
            ticket = ps._store.add(key("joins"), 1)
            ps._store.set(key(f"join{ticket}"), join)
            assert sessions.await_key(ps._store, key(f"accepted{ticket}"), 10.0)
            out["joins"].append((ticket, ps._store.get(key(f"accepted{ticket}")).decode()))
        # the wire: the old wire's pickled header, a new frame with a pickled header, a tensor
        # spec the frame cannot hold, a value naming a function
        pickled = pickle.dumps((0, _Touch(marker)))
        frames = [_frame(wire.REQUEST, pickled, words=6), _frame(wire.REQUEST, pickled),
                  _frame(wire.REQUEST, json.dumps([[["float32", [1 << 20], wire.INLINE, -1]], {}]).encode(), count=1),
                  _frame(wire.REQUEST, json.dumps([[], [1, {"data": ["posix.system", [f"touch {marker}"]]}]]).encode())]
        out["closed"] = [_impostor(ps, frame) for frame in frames]
        out["after"] = ps.call(0, "echo", "double", torch.ones(2)).tolist()  # on a new session
        out["ran"] = marker.exists()
        return out
    finally:
        ps.stop()
        logging.getLogger("shadowgba").removeHandler(warnings)
        out["warnings"] = warnings.messages


def test_crafted_wire_messages_and_store_joins_are_refused_and_the_server_serves_on(tmp_path: Path) -> None:
    """A join that is a pickle or names another ticket is refused by the acceptor, naming the key; a
    session that sends a pickled frame (old or new layout), a spec that does not match or a value
    naming a function is closed by the server, naming the trainer and the session; no payload ran,
    and the trainer's next call is answered on a new session (the acceptor still takes them)."""
    trainer, server = run_ranks(_crafted_wire_and_store, 2, str(tmp_path), timeout_s=90)
    assert trainer["before"] == trainer["after"] == [2.0, 2.0]
    assert not trainer["ran"] and not (tmp_path / "ran").exists()
    (pickled, pickled_answer), (other, other_answer) = trainer["joins"]
    assert pickled_answer.startswith(f"refused: refused ps/gen1/server0/1/join{pickled}: not JSON written by "
                                     "shadowgba"), pickled_answer
    assert other_answer == f"refused: refused ps/gen1/server0/1/join{other}: it names session 99", other_answer
    assert trainer["closed"] == [True] * 4, trainer["closed"]
    refusals = [message for message in server["warnings"] if "closed session" in message]
    assert len(refusals) == 4, server["warnings"]
    expected = ["does not start with this wire's magic", "its header is not JSON", "inline tensors overrun the frame",
                "'posix.system' is no dataclass registered with the codec"]
    for message, why in zip(refusals, expected):
        assert message.startswith("shadowgba: ps0 closed session ") and "of trainer 0 (rank 0): refused " in message \
            and "from trainer 0 (rank 0)" in message and why in message, message
    assert sum("acceptor refused" in message for message in server["warnings"]) == 2, server["warnings"]
