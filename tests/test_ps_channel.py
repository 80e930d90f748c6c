"""The PS channel (`shadowgba.ps.channel`) on its own: framing, same-host lanes, many calls in
flight, a lost peer.

Two spawned ranks build one channel (rank 0 the server end answering with a toy handler, rank 1
the trainer end), as a trainer-server session does, over the harness's default store.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shadowgba.ps import channel as links
from shadowgba.ps import wire
from shadowgba.ps import lane
from shadowgba.ps.board import Board, BoardView, StaleBoard
from shadowgba.ps.channel import Channel, ChannelLost
from shadowgba.ps.wire import Answer, Frame, Reply, Request, encode
from shadowgba.ps.same_host import LOOP_NICE, loop_threads
from tests.multiprocess import run_ranks, run_ranks_outcomes

pytestmark = pytest.mark.timeout(120)

SMALL_FRAME_BYTES = 4096
"""`FRAME_BYTES` in these tests (with an `INLINE_TENSOR_BYTES` of 64), so that messages of a few KB
already take the paths of big ones (a staged tensor, tensors sent apart, headers apart)."""
SMALL_LANE_BYTES = 32 << 10
"""`LANE_BYTES` in the many-calls test: a ring that 200 calls of up to 20 KB wrap and fill often."""
SILENCE_S = 2.0
"""The channels' timeout in the stopped-peer case: how long a receive waits for any frame."""


def mixed_body() -> dict[str, Any]:
    """Tensors of every kind a call carries: dtypes, shapes, empty, views, nested in containers."""
    base = torch.arange(24, dtype=torch.float32)
    return {
        "f32": base.reshape(2, 3, 4), "bf16": torch.linspace(-1, 1, 7, dtype=torch.bfloat16),
        "i64": torch.tensor([3, -1, 2**40]), "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 5), "scalar": torch.tensor(2.5, dtype=torch.float64),
        "view": base[5:9], "strided": base.reshape(4, 6)[:, ::2], "u8": torch.arange(5, dtype=torch.uint8),
        "big": torch.randn(SMALL_FRAME_BYTES),  # too big for a small frame: sent as itself
        "nested": [("text", 1, None, {"x": torch.ones(2, dtype=torch.int32)})],
    }


def assert_same(left: Any, right: Any) -> None:
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor) and left.dtype == right.dtype and left.shape == right.shape
        torch.testing.assert_close(left, right, rtol=0, atol=0)
    elif isinstance(left, dict):
        assert left.keys() == right.keys()
        for key in left:
            assert_same(left[key], right[key])
    elif isinstance(left, (list, tuple)):
        assert type(left) is type(right) and len(left) == len(right)
        for a, b in zip(left, right):
            assert_same(a, b)
    else:
        assert left == right


def decoded(message: Any) -> Any:
    """`message` through `encode` and `Frame.decode`, tensors sent apart handed over as a peer's receive would."""
    encoded = encode(message)
    frame = Frame.read(encoded.frame, "the test")
    header = frame.header_bytes(encoded.header)

    sent = {tag: tensor for tensor, tag in encoded.sends}
    staged = sent.pop(wire.STAGED_TAG, None)
    buffer = torch.empty(wire.STAGED_BYTES, dtype=torch.uint8)
    if staged is not None:
        buffer[:staged.numel() * staged.element_size()] = staged.reshape(-1).view(torch.uint8)

    def receive(tensors: list[tuple[torch.Tensor, int]]) -> None:
        for target, tag in tensors:
            target.copy_(sent[tag])

    return frame.decode(header, buffer, receive)


def test_framing_round_trips_mixed_tensors_dtypes_empty_tensors_and_big_headers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    small = {"ids": torch.arange(10), "rows": torch.ones(3, 4)}
    message = encode(Reply((Answer(1, small),)))
    assert message.sends == [] and message.header is None  # a small message is one frame
    assert_same(decoded(Reply((Answer(1, small),))).answers[0].value, small)
    body = mixed_body()
    assert encode(Request(7, body)).sends == []  # it all fits in a frame
    assert_same(decoded(Request(7, body)).body, body)
    monkeypatch.setattr(wire, "FRAME_BYTES", SMALL_FRAME_BYTES)
    monkeypatch.setattr(wire, "INLINE_TENSOR_BYTES", 64)
    tags = [tag for _, tag in encode(Request(7, body)).sends]
    assert tags[0] == wire.STAGED_TAG and len(tags) >= 2, tags  # the first large one staged, the rest apart
    assert_same(decoded(Request(7, body)).body, body)
    long_header = {"names": [f"name {i} " * 5 for i in range(200)], "t": torch.ones(2)}  # over a small frame
    assert encode(Request(0, long_header)).header is not None
    assert_same(decoded(Request(0, long_header)).body, long_header)
    with pytest.raises(TypeError, match="dense CPU tensors"):
        encode(Request(0, torch.ones(2).to_sparse()))


def test_the_codec_round_trips_its_rules_and_refuses_what_it_did_not_write() -> None:
    """Every value rule of `shadowgba.ps.codec` round trips (registered dataclasses, enums, exceptions
    with their attributes and notes); a type without a rule is refused when sent, and data it did
    not write (unknown tags or classes, fields of another type, a SystemExit) when received."""
    from shadowgba.errors import PeerLost
    from shadowgba.gba.mode import Mode
    from shadowgba.gba.shards import ShardReply
    from shadowgba.ps.transport import Caller
    from shadowgba.ps import codec

    codec.register(Mode)
    error = PeerLost("server 0 is gone", ranks=[2])
    error.add_note("raised by service 'dense'")
    value = {("k", 1): [None, True, -3, 2.5, float("inf"), "s", b"\x00token"], 7: torch.Size([2, 3]),
             "dtype": torch.bfloat16, "mode": Mode.GBA, "reply": ShardReply(torch.ones(2), 4, "sync", 0.5),
             "error": error, "opaque": OSError(5, "I/O")}
    tensors: list[torch.Tensor] = []
    decoded = codec.decode_value(json.loads(json.dumps(codec.encode_value(value, tensors))), tensors, "the test")
    error_back = decoded.pop("error")
    assert type(error_back) is PeerLost and error_back.ranks == (2,) and error_back.__notes__ == error.__notes__
    assert type(decoded["opaque"]) is OSError and decoded.pop("opaque").errno == 5
    assert decoded.pop("mode") is Mode.GBA and decoded.pop("dtype") is torch.bfloat16
    reply = decoded.pop("reply")
    assert type(reply) is ShardReply and torch.equal(reply.params, torch.ones(2)) and reply.requested_mode == "sync"
    value = {key: item for key, item in value.items() if key not in ("error", "opaque", "mode", "dtype", "reply")}
    assert_same(decoded, value)
    with pytest.raises(codec.Unencodable, match="no rule encodes a .*MonkeyPatch"):
        codec.encode_value(pytest.MonkeyPatch(), [])
    with pytest.raises(codec.Unencodable, match=r"Caller\.trainer: must be int, got str"):  # refused when sent
        codec.encode_value(Caller("0", 1), [])
    typed = codec.encode_value(Caller(0, 1, (2,)), [])  # fields by their annotations: no names, no tags
    assert typed == {"data": ["shadowgba.ps.transport.Caller", [0, 1, [2]]]}, typed
    foreign = codec.encode_value(type("Foreign", (Exception,), {})("x"), [])  # a class outside builtins/shadowgba
    assert foreign == {"error": ["builtins.RuntimeError", ["tests.test_ps_channel.Foreign: x"], {"dict": []}]}
    refused = [({"pickle": "gASV"}, "unknown value tag 'pickle'"),
               ({"data": ["os.system", ["ls"]]}, "'os.system' is no dataclass registered"),
               ({"data": ["shadowgba.ps.transport.Caller", ["0", 1, []]]}, "Caller.trainer must be int, got str"),
               ({"data": ["shadowgba.ps.transport.Caller", [0]]}, "has the fields"),
               ({"data": ["shadowgba.ps.transport.Caller", {"trainer": 0, "number": 1, "settled": []}]},
                "has the fields"),  # by name: the codec before this one
               ({"error": ["builtins.SystemExit", [0], {"dict": []}]}, "no exception class of builtins or shadowgba"),
               ({"tensor": 3}, "tensor index 3 outside"), ({"tuple": [1], "x": 2}, "a JSON dict that is no value")]
    for data, why in refused:
        with pytest.raises(codec.Malformed, match=f"refused data from the test: .*{why}"):
            codec.decode_value(data, [], "the test")


def test_a_lane_wraps_refuses_when_full_and_its_file_lives_only_until_mapped() -> None:
    ring = 4096
    out = lane.OutgoingLane.create(ring + 64)  # 64: the token's room before the ring
    assert out is not None and os.path.exists(out.path)
    path, size, token = out.offer
    assert lane.IncomingLane.open(path, size, bytes(16)) is None  # another token: not this writer's file
    assert lane.IncomingLane.open(path + "-elsewhere", size, token) is None  # no such file: another host
    assert out.reserve(8) is None  # not accepted yet: over gloo
    reader = lane.IncomingLane.open(path, size, token)
    assert reader is not None and not os.path.exists(path)  # mapped, then unlinked by the reader
    out.accepted = True
    assert out.reserve(ring // 2 + 1) is None  # more than half the ring: over gloo
    first, second, third = torch.arange(300.0), torch.arange(200), torch.full((400,), 7.0)  # 1200, 1600, 1600 B
    at_first, at_second = out.reserve(1200), out.reserve(1600)
    assert (at_first, at_second) == (0, 1216)  # 64-byte aligned, back to back
    out.write(at_first, first)
    out.write(at_second, second)
    assert out.reserve(1600) is None  # would cross the end, and the next turn is not read yet
    got_first, got_second = torch.empty(300), torch.empty(200, dtype=torch.int64)
    reader.read(at_first, got_first)
    out.release(reader.released)
    assert out.reserve(1600) is None  # the next turn still overlaps the unread second tensor
    reader.read(at_second, got_second)
    out.release(reader.released)
    at_third = out.reserve(1600)
    assert at_third == ring  # the next turn, ring offset 0
    out.write(at_third, third)
    got_third = torch.empty(400)
    reader.read(at_third, got_third)
    assert torch.equal(got_first, first) and torch.equal(got_second, second) and torch.equal(got_third, third)
    out.close()  # the file is already gone: nothing to do, no error


def test_a_lent_tensor_holds_its_lane_region_until_it_and_every_view_of_it_are_freed() -> None:
    ring = 4096
    out = lane.OutgoingLane.create(ring + 64)
    reader = lane.IncomingLane.open(*out.offer)
    out.accepted = True
    first, second = torch.arange(400.0), torch.arange(400.0) * 2  # 1600 B each
    at_first, at_second = out.reserve(1600), out.reserve(1600)
    out.write(at_first, first)
    out.write(at_second, second)
    lent_first = reader.lend(at_first, torch.float32, (20, 20))
    lent_second = reader.lend(at_second, torch.float32, (400,))
    assert torch.equal(lent_first.reshape(-1), first) and torch.equal(lent_second, second)
    kept = lent_first[3:5]  # a view of a view: it shares the region's memory
    del lent_first
    assert reader.released == at_first  # held by the view
    del lent_second
    assert reader.released == at_first  # freed out of order: still held by the oldest region
    out.release(reader.released)
    assert out.reserve(1600) is None  # the next turn would overlap the held region
    del kept
    assert reader.released == at_second + 1600  # both regions free
    out.release(reader.released)
    assert out.reserve(1600) == ring  # the next turn
    assert not reader.worth_telling(reader.released) and reader.worth_telling(0)


def test_a_board_copy_is_held_while_any_view_of_it_lives_and_only_its_host_maps_it() -> None:
    board = Board.create(4096 + 64)
    assert board is not None
    view = BoardView.open(*board.offer)  # this process: the same host
    pid, fd, size, token = board.offer
    assert BoardView.open(pid, fd, size, bytes(16)) is None  # another token: not this board
    assert BoardView.open(pid, 10**6, size, token) is None  # no such descriptor (another host's)
    params = torch.linspace(-1, 1, 500)
    copies = [board.copy(params, torch.bfloat16), board.copy(params, torch.float32)]  # 1000 + 2000 B
    assert [board.position_of(copy) for copy in copies] == [0, 1024]
    assert board.copy(params, torch.float32) is None  # no room while both are held
    assert board.position_of(params) is None and board.position_of(copies[1][10:20]) is not None
    out = torch.empty(500)
    view.read(board.position_of(copies[1]), out)
    assert torch.equal(out, params) and torch.equal(copies[0], params.to(torch.bfloat16))
    kept = copies[0][:4]  # a view holds its copy's region
    del copies
    assert board.copy(params, torch.float32) is None  # the first region is still held by `kept`
    del kept
    fresh = board.copy(params, torch.float32)
    assert board.position_of(fresh) == 4096  # would cross the end: the next turn, over the first two
    view.read(4096, out)
    assert torch.equal(out, params)
    with pytest.raises(StaleBoard, match="overwritten before it was read"):  # a late reader of the first copy
        view.read(0, torch.empty(500, dtype=torch.bfloat16))
    board.close()


def channel_end(rank: int, timeout_s: float, handler: Any = None, on_lost: Any = None, lanes: bool = True,
                lane_bytes: int | None = None, board: Board | None = None) -> Channel:
    """This rank's end of a channel over the harness's store (server rank 0 answers with `handler`,
    lending the tensors of its lane as the transport's server end does, and naming those on `board`)."""
    store = dist.PrefixStore("channel-test", dist.distributed_c10d._get_default_store())
    before = loop_threads()  # the harness's default group's
    group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))
    peer = "trainer 1 (rank 1)" if rank == 0 else "ps0"
    return Channel(group, rank, peer, on_request=handler, on_lost=on_lost, timeout_s=timeout_s,
                   peer_timeout_s=timeout_s, lanes=lanes, loop_threads=sorted(loop_threads() - before),
                   lane_bytes=lane_bytes, lend=rank == 0, board=board)


def pulse(end: Channel) -> threading.Event:
    """Drive `end`'s heartbeats from a thread until the returned event is set (the transport's pulse)."""
    ended = threading.Event()

    def beat() -> None:
        while not ended.wait(0.05):
            end.pulse()

    threading.Thread(target=beat, daemon=True).start()
    return ended


def answer_in_threads(channel: Channel, request_id: int, body: Any) -> None:
    """A server end's handler: answer each request from a thread of its own, the slow ones last."""
    delay_s, payload = body

    def run() -> None:
        time.sleep(delay_s)
        channel.reply(request_id, payload)

    threading.Thread(target=run, daemon=True).start()


def concurrent_calls(rank: int, world_size: int, lanes: bool) -> dict[str, Any]:
    """200 requests in flight from 4 threads, answered out of order: each future gets its own reply
    (frames of SMALL_FRAME_BYTES: the bigger requests and replies send their tensors apart). With
    `lanes`, through rings of SMALL_LANE_BYTES that wrap and fill many times (a tensor that finds no
    room goes over gloo, in the same message as others in the ring); the server end echoes each
    request's tensors as it got them, lent views of its lane held for up to 0.1 s while later
    requests fill the ring, except every other request's rows, which it answers with a copy on its
    board (as small as a lane: regions are reused all the time). Rank 0 returns how many of its
    requests' rows tensors were lent, and how many replies went through the board."""
    wire.FRAME_BYTES, wire.INLINE_TENSOR_BYTES, lane.LANE_BYTES = SMALL_FRAME_BYTES, 64, SMALL_LANE_BYTES
    lent, boarded = [], []
    board = Board.create() if rank == 0 else None

    def answer_and_count(channel: Channel, request_id: int, body: Any) -> None:
        delay_s, payload = body
        rows = payload.get("rows") if isinstance(payload, dict) else None
        ring = channel.lane_buffers().get("in")
        if rows is not None and ring is not None and \
                ring.data_ptr() <= rows.data_ptr() < ring.data_ptr() + ring.numel():
            lent.append(request_id)
        copy = board.copy(rows, rows.dtype) if rows is not None and lanes and payload["index"] % 2 else None
        if copy is not None:
            boarded.append(request_id)
            body = (delay_s, {**payload, "rows": copy})
        answer_in_threads(channel, request_id, body)

    end = channel_end(rank, 30.0, answer_and_count if rank == 0 else None, lanes=lanes, board=board)
    if rank == 0:
        end.wait_closed(60.0)  # the trainer end closes when done
        return {"lent": len(lent), "boarded": len(boarded)}
    results: dict[int, Any] = {}

    def caller(first: int) -> None:
        futures = {index: end.request((0.05 * (index % 3), {"index": index, "rows": torch.full((index, 3), index)}))
                   for index in range(first, 200, 4)}
        for index, future in futures.items():
            results[index] = future.wait()

    threads = [threading.Thread(target=caller, args=(first,)) for first in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    body = mixed_body()
    echoed = end.request((0.0, body)).wait()
    used = end.lanes
    nice = {thread: os.getpriority(os.PRIO_PROCESS, thread) for thread in loop_threads()}
    end.close(wait_s=10.0)
    return {"results": results, "echoed": echoed, "expected": body, "lanes": used, "nice": nice,
            "loop_threads": end._loop_threads, "own_nice": os.getpriority(os.PRIO_PROCESS, 0)}


@pytest.mark.parametrize("lanes", [True, False], ids=["same-host-lanes", "gloo-only"])
def test_many_concurrent_calls_in_flight_get_their_own_replies(lanes: bool) -> None:
    server, trainer = run_ranks(concurrent_calls, 2, lanes, timeout_s=90)
    assert trainer["lanes"] == (lanes, lanes)  # both directions mapped (one host), or none offered
    # lent views of the lane, kept while the ring wrapped, and board copies whose regions were reused
    # still hold what was sent (checked below)
    assert (server["lent"] >= 10 and server["boarded"] >= 10) if lanes else (server["lent"] == server["boarded"] == 0), server
    # the channel's gloo loop yields to every other thread once it only reads frames; others keep theirs
    assert trainer["loop_threads"] and set(trainer["loop_threads"]) < set(trainer["nice"]), trainer["nice"]
    for thread, nice in trainer["nice"].items():
        # the others at the process's own niceness (the suite may run niced itself)
        assert nice == (LOOP_NICE if lanes and thread in trainer["loop_threads"] else trainer["own_nice"]), trainer["nice"]
    assert sorted(trainer["results"]) == list(range(200))
    for index, reply in trainer["results"].items():
        assert reply["index"] == index
        torch.testing.assert_close(reply["rows"], torch.full((index, 3), index))
    assert_same(trainer["echoed"], trainer["expected"])


BIG_LANE_BYTES = 48 << 20
"""`big_tensor_through_a_big_lane`'s lanes: room for a tensor of more than half the default lane."""


def big_tensor_through_a_big_lane(rank: int, world_size: int) -> dict[str, Any]:
    """A 20 MB tensor (over half of a default lane) echoed through channels whose lanes hold
    BIG_LANE_BYTES: what the trainer got back, its lane's size, and the bytes its lane carried."""
    end = channel_end(rank, 30.0, answer_in_threads if rank == 0 else None, lane_bytes=BIG_LANE_BYTES)
    if rank == 0:
        end.wait_closed(60.0)
        return {}
    # the peer maps the lane after the handshake, and until it has, requests go over gloo (a race a
    # loaded CI machine lost once: the 20 MB came back right, but not through the lane)
    accepted_by = time.monotonic() + 20.0
    while end.lanes != (True, True) and time.monotonic() < accepted_by:
        time.sleep(0.01)
    big = torch.arange(5 << 20, dtype=torch.float32)
    echoed = end.request((0.0, big)).wait()
    seen = {"equal": torch.equal(echoed, big), "lane": end.lane_buffers()["out"].numel(),
            "written": end._lane_out._written, "lanes": end.lanes}
    end.close(wait_s=10.0)
    return seen


def test_a_tensor_over_half_a_default_lane_goes_through_a_lane_sized_for_it() -> None:
    assert 20 << 20 > lane.LANE_BYTES // 2  # the default lane would send it over gloo
    trainer = run_ranks(big_tensor_through_a_big_lane, 2, timeout_s=90)[1]
    assert trainer["equal"] and trainer["lanes"] == (True, True), trainer
    assert trainer["lane"] == BIG_LANE_BYTES and trainer["written"] >= 20 << 20, trainer


def lost_peer(rank: int, world_size: int, how: str) -> dict[str, Any] | None:
    """Rank 0 (server end) never answers; rank 1 sends 3 requests, then rank 0 is killed or stopped:
    when and how the pending requests fail on rank 1."""
    timeout_s = SILENCE_S if how == "stop" else 60.0
    lost = threading.Event()
    end = channel_end(rank, timeout_s, (lambda *_: None) if rank == 0 else None, lambda *_: lost.set())
    pulse(end)  # both ends beat: only the stop silences rank 0
    dist.barrier()
    if rank == 0:
        time.sleep(0.5)  # the requests are in flight
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(60)  # stopped for good: the harness kills it
        return None
    pending = [end.request((0.0, index)) for index in range(3)]
    time.sleep(0.5)
    started = time.monotonic()
    errors = []
    for future in pending:
        try:
            future.wait()
        except ChannelLost as error:
            errors.append((str(error), error.timed_out))
    waited_s = time.monotonic() - started
    return {"errors": errors, "waited_s": waited_s, "told_owner": lost.wait(5.0),
            "refused_after": isinstance(_refusal(end), ChannelLost)}


def _refusal(end: Channel) -> BaseException | None:
    try:
        end.request((0.0, "late")).wait()
    except BaseException as error:  # noqa: BLE001 (the test reads what a dead channel raises)
        return error
    return None


def test_a_killed_peer_fails_every_pending_call_at_once_naming_it() -> None:
    outcomes = run_ranks_outcomes(lost_peer, 2, "kill", timeout_s=60)
    assert outcomes[0].killed, outcomes[0]
    seen = outcomes[1].value
    assert len(seen["errors"]) == 3 and seen["told_owner"] and seen["refused_after"], seen
    for message, timed_out in seen["errors"]:
        assert message.startswith("ps0 closed its connection") and not timed_out, message
    assert seen["waited_s"] < 1.5, seen  # the connection closed: no timeout waited out


def test_a_stopped_peer_is_lost_after_the_timeout_naming_it() -> None:
    outcomes = run_ranks_outcomes(lost_peer, 2, "stop", timeout_s=60, stopped_for_good=True)
    assert outcomes[0].stopped, outcomes[0]
    seen = outcomes[1].value
    assert len(seen["errors"]) == 3 and seen["told_owner"], seen
    for message, timed_out in seen["errors"]:
        assert message.startswith(f"ps0 sent nothing for {SILENCE_S:g} s") and timed_out, message
    # rank 0 beat until it was stopped: lost about one silence limit later, not before
    assert SILENCE_S - 1.0 <= seen["waited_s"] < SILENCE_S + 3.0, seen


def idle_link(rank: int, world_size: int) -> dict[str, Any]:
    """Both ends idle for 3 silence limits: the heartbeats keep the channel alive."""
    saved, links.PING_INTERVAL_S = links.PING_INTERVAL_S, 0.2
    try:
        end = channel_end(rank, 1.0, (lambda channel, request_id, body: channel.reply(request_id, body))
                          if rank == 0 else None)
        pulse_ended = pulse(end)
        time.sleep(3.0)
        alive = end.alive
        answer = end.request((0.0, "still there")).wait() if rank == 1 else None
        dist.barrier()
        pulse_ended.set()
        return {"alive": alive, "answer": answer}
    finally:
        links.PING_INTERVAL_S = saved


def test_heartbeats_keep_an_idle_channel_alive_past_its_timeout() -> None:
    server, trainer = run_ranks(idle_link, 2, timeout_s=60)
    assert server["alive"] and trainer["alive"] and trainer["answer"] == (0.0, "still there")
