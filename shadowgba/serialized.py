"""State as bytes and files that hold data only: tensors, numbers, strings and plain containers.

Every state the library saves outside DCP's own tensors (a trainer's blobs in a checkpoint, a PS
shard's exported state, a server's checkpoint file) is written by `torch.save` and read back by
torch's `weights_only` unpickler, which refuses every other object: loading a crafted file never
runs code it carries. What the library saves is kept to such data (configs as plain mappings,
counters as numbers, numpy's RNG state as a tensor).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

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
    return _load_weights_only(io.BytesIO(blob), what)


def load_state_file(path: str | os.PathLike) -> Any:
    """A file written by `torch.save` of tensors and plain containers, refused as `state_from_bytes`
    refuses a blob."""
    with open(path, "rb") as file:
        return _load_weights_only(file, str(path))


def _load_weights_only(file: Any, what: str) -> Any:
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"checkpoint entry '{what}' holds an object other than tensors and plain containers, which "
            f"shadowgba never saves and will not load (it could run code): {str(error).splitlines()[0]}") from error


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
