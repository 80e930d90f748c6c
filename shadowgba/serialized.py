"""Checkpoints that hold data only, in one format: state as bytes and files, loaded state checked.

Every state the library saves outside DCP's own tensors (a trainer's blobs in a checkpoint, a PS
shard's exported state, a server's checkpoint) is written by `torch.save` and read back by torch's
`weights_only` unpickler, which refuses every other object (`load_weights_only`). What the library
saves is kept to such data (configs as plain mappings, counters as numbers, numpy's RNG state as a
tensor). DCP's own files are read as safely by `shadowgba.checkpoint_reader` (its `.metadata` by an
unpickler of DCP's metadata classes only), so loading a crafted checkpoint never runs code it carries.

One checkpoint format, trainers' (`shadowgba.checkpoint`: DCP's files) and servers'
(`shadowgba.ps.server_state`: one `torch.save` file) alike: a folder `step_<k>` holding the data
files and `shadowgba.json`, its manifest (format, step, what setup wrote it, and the size and CRC-32
of every file). It is written as `.tmp-step_<k>`, sealed (`commit_folder`: checksums, manifest,
flush) and renamed into place, so a crash leaves the previous checkpoint whole; on loading,
`verify_folder` checks every file against the manifest before anything is read.

A loaded state's shape is checked once, before any of it is used (`check_entries`, `check_count`).
"""

from __future__ import annotations

import datetime
import io
import json
import os
import pickle
import re
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from shadowgba.errors import CheckpointError


def state_to_bytes(value: Any) -> bytes:
    """`value` (tensors, numbers, strings, and dicts / lists / tuples / sets of them) as one blob that
    `state_from_bytes` reads back."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def state_from_bytes(blob: Any, what: str) -> Any:
    """A `state_to_bytes` blob read back on the CPU, refusing (`CheckpointError` naming `what`) what is
    not one or holds anything but tensors and plain containers: a checkpoint is data, and loading one
    never runs code it carries (torch's `weights_only` unpickler refuses every other object)."""
    if not isinstance(blob, (bytes, bytearray)):
        raise CheckpointError(f"checkpoint entry '{what}' is not a serialized state ({type(blob).__name__})")
    return load_weights_only(io.BytesIO(blob), what)


def load_state_file(path: str | os.PathLike) -> Any:
    """A file written by `torch.save` of tensors and plain containers, refused as `state_from_bytes`
    refuses a blob."""
    with open(path, "rb") as file:
        return load_weights_only(file, str(path))


def load_weights_only(file: Any, what: str) -> Any:
    """What `torch.save` wrote to `file`, read by torch's `weights_only` unpickler on the CPU;
    `CheckpointError` naming `what` when it holds anything but tensors and plain containers."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"checkpoint entry '{what}' holds an object other than tensors and plain containers, which "
            f"shadowgba never saves and will not load (it could run code): {str(error).splitlines()[0]}") from error


def check_entries(state: Any, what: str, keys: Sequence[str], exact: bool = False) -> Mapping[str, Any]:
    """`state` if it is a mapping holding every one of `keys` (and no other, with `exact`): the one
    check of a loaded state's shape, before any of it is read. Else `CheckpointError` naming `what`
    (e.g. "ShadowSync state"), the keys it lacks and those it has; nothing was changed."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{what} is a mapping with keys {list(keys)}, got {type(state).__name__}")
    missing = [key for key in keys if key not in state]
    extra = sorted(map(str, set(state) - set(keys))) if exact else []
    if missing or extra:
        raise CheckpointError(f"{what} lacks {missing}" + (f" and has no place for {extra}" if extra else "")
                              + f"; it has {sorted(map(str, state))} (is it the state_dict() of this kind?)")
    return state


def check_count(value: Any, what: str) -> int:
    """`value` if it is an integer >= 0 (a step, a streak), else `CheckpointError` naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{what} must be an integer >= 0, got {value!r}")
    return value


MANIFEST = "shadowgba.json"
"""Every checkpoint folder's manifest: format, step, setup, and the size and CRC-32 of every file."""
FORMAT = 1
TMP_PREFIX = ".tmp-"
"""A folder being written; never read, and removed by the next writer of the directory."""
_STEP_FOLDER = re.compile(r"^step_(\d{8,})$")


def step_folders(directory: Path) -> list[tuple[int, Path]]:
    """The committed checkpoint folders in `directory`, (step, path), oldest first."""
    if not directory.is_dir():
        return []
    found = [(int(match.group(1)), entry) for entry in directory.iterdir()
             if (match := _STEP_FOLDER.match(entry.name)) and entry.is_dir()]
    return sorted(found)


def commit_folder(tmp: Path, final: Path, step: int, setup: Mapping[str, Any], keep_last: int) -> None:
    """Seal the folder `tmp` as the checkpoint of step `step` written by `setup`: checksum every file,
    write the manifest, flush, rename it to `final` (replacing one of the same step an earlier run
    left), and keep the newest `keep_last` checkpoints of its directory."""
    files = {}
    for file in sorted(tmp.rglob("*")):
        if file.is_file():
            size, crc = _size_and_crc(file)
            files[str(file.relative_to(tmp))] = {"size": size, "crc32": crc}
    manifest = {"format": FORMAT, "step": step, "setup": dict(setup), "files": files,
                "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    for _, old in step_folders(final.parent)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def verify_folder(path: Path, check_setup: Callable[[Any], str | None] | None = None) -> dict[str, Any]:
    """The manifest of the checkpoint folder `path`, once its setup fits (`check_setup(setup)`: the
    difference, or None) and every file it lists has the size and CRC-32 written: else
    `CheckpointError` naming the path and what is wrong (no data file was read)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files, setup, manifest["step"] = manifest["files"], manifest["setup"], int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {path} is corrupted or incomplete: cannot read {MANIFEST} "
                              f"({error!r})") from None
    difference = check_setup(setup) if check_setup is not None else None
    if difference:
        raise CheckpointError(f"checkpoint {path} does not fit this job: {difference}")
    for name, expected in sorted(files.items()):
        file = path / name
        try:
            size, crc = _size_and_crc(file)
        except OSError:
            raise CheckpointError(f"checkpoint {path} is corrupted: {file} is missing") from None
        if size != expected["size"]:
            raise CheckpointError(f"checkpoint {path} is truncated or corrupted: {file} has {size} bytes, "
                                  f"{expected['size']} were written")
        if crc != expected["crc32"]:
            raise CheckpointError(f"checkpoint {path} is corrupted: {file} fails its CRC-32 check")
    return manifest


def _size_and_crc(file: Path) -> tuple[int, int]:
    crc, size = 0, 0
    with open(file, "rb") as stream:
        while chunk := stream.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename in it) to disk; best effort: a file system that cannot is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
