"""DCP loads that never unpickle arbitrary bytes: the storage reader and load planner of `Checkpointer`.

    dcp.load(state, checkpoint_id=path, storage_reader=SafeReader(path), planner=SafeLoadPlanner())

torch.distributed.checkpoint (torch 2.13) reads a checkpoint's `.metadata` with `pickle.load` and
every non-tensor item with `torch.load` and `weights_only` off: a crafted folder runs code on
`--resume`, and the seal in `shadowgba.json` (sizes and CRC-32s) cannot stop it, since anyone who
can write the folder can recompute it. Here:
- `.metadata` is read by `_MetadataUnpickler`, which builds only the classes a DCP metadata file
  holds (`METADATA_GLOBALS`: DCP's metadata dataclasses, `torch.Size`, torch's dtypes and layouts,
  `pathlib.PosixPath`, as torch 2.13's `metadata.py` and `filesystem.py` define and this project's
  checkpoints hold them), and must name only files of its own folder;
- bytes items (what the library saves for each trainer, `serialized.state_to_bytes`, and plain
  values of a `state_dict`) are read by torch's `weights_only` unpickler (`serialized.load_weights_only`),
  as DCP itself reads tensor items.
Anything else is refused with a `CheckpointError` naming the file, before any object it names is
built. Checkpoints this release wrote hold nothing else, and load unchanged.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from shadowgba.errors import CheckpointError
from shadowgba.serialized import load_weights_only

METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{(cls.__module__, cls.__qualname__): cls for cls in (
        dcp_metadata.Metadata, dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties, dcp_metadata.StorageMeta,
        dcp_metadata.MetadataIndex, dcp_metadata._MEM_FORMAT_ENCODING, _StorageInfo, torch.Size, pathlib.PosixPath)},
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}
"""The only globals a `.metadata` may name, (module, name) -> object: DCP's metadata dataclasses and
the enum `TensorProperties` pickles its memory format as, the filesystem reader's `_StorageInfo`,
`torch.Size`, torch's dtypes (pickled as `torch.float32` ...), `torch.serialization._get_layout`
(how torch pickles a layout: a lookup of torch's layouts by name) and `pathlib.PosixPath` (a
checkpoint id). `pathlib.Path` is pickled as its concrete class."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a `.metadata`, building no class outside `METADATA_GLOBALS`."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = METADATA_GLOBALS.get((module, name))
        if allowed is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which no DCP metadata holds")
        return allowed


class SafeReader(FileSystemReader):
    """DCP's file-system reader with `.metadata` read by `_MetadataUnpickler`; every failure to read
    a file of the checkpoint (a refused object, a corrupted item) raises `CheckpointError` naming it."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._reading: str | None = None
        """The file `read_data` is reading from (for its errors)."""

    def read_metadata(self, *args: Any) -> dcp_metadata.Metadata:
        """The checkpoint's `.metadata`. Without DCP's `rank` keyword, so that DCP does not fall back
        to per-rank metadata files when this one is refused (the library writes none)."""
        path = self._get_metadata_path()
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except Exception as error:  # noqa: BLE001 (whatever a crafted or damaged file makes the unpickler raise)
            raise CheckpointError(f"checkpoint file {path} is refused: {str(error)[:200]} (only DCP's metadata "
                                  "classes are loaded from it: anything else could run code)") from None
        if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.storage_data, dict):
            raise CheckpointError(f"checkpoint file {path} is refused: it holds a {type(metadata).__name__}, not "
                                  "DCP's Metadata")
        for index, info in metadata.storage_data.items():
            name = getattr(info, "relative_path", None)
            if not isinstance(info, _StorageInfo) or not isinstance(name, str) or name != os.path.basename(name) \
                    or name in ("", ".", ".."):
                raise CheckpointError(f"checkpoint file {path} is refused: item {index} is stored in {name!r}, "
                                      "not in a file of the checkpoint's own folder")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> IO[bytes]:
        self._reading = sinfo.relative_path
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, planner)
        except Exception as error:  # noqa: BLE001 (a refused item, a torn one, a size that does not match)
            raise CheckpointError(f"checkpoint file {pathlib.Path(self.path, self._reading or '')} is refused: "
                                  f"{str(error)[:300]}") from error


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with bytes items read by the `weights_only` unpickler, and without
    its pre-2.4 fallback: each trainer requests only its own `trainer{i}` entries, so the checkpoint
    holds keys this rank does not ask for; the default planner takes that as the sign of a torch
    <= 2.3 checkpoint and re-flattens the request the old way (a dict without tensors as one entry),
    which then misses. Checkpoints written here are never that old."""

    def create_local_plan(self) -> LoadPlan:
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_weights_only(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
