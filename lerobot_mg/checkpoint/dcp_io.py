"""Reading DCP shards at file speed, without changing their format, and without running a checkpoint's code.

torch's ``FileSystemReader`` stores each tensor as a ``torch.save`` archive inside a ``.distcp`` file and loads it
with ``torch.load`` into fresh memory, then copies it into the target tensor: two passes over every byte plus the
archive's bookkeeping (6.4x a plain read of the same bytes, scripts/bench_dcp.py). :class:`InPlaceFileSystemReader`
reads the same files: it reads the tensor's dtype, shape and strides from the archive's data.pkl (a restricted
unpickler, :mod:`lerobot_mg.checkpoint.unpickle`), finds the data record in the zip directory, and ``readinto``s it
straight into the target tensor when the target is a whole, contiguous CPU tensor of the stored dtype (the common
case: a resume on the topology that saved). Anything else (a resharded slice, a GPU target, another dtype) is read
once into a CPU buffer and copied. ``.metadata`` and byte items are read through the allow-lists of
:mod:`lerobot_mg.checkpoint.unpickle` (torch's reader would ``pickle.load`` them), each item's archive is checked
before anything of it is read (stored, not compressed; within the item), and every shard path must stay inside the
checkpoint folder (:func:`lerobot_mg.safe_paths.contained`). The writer (:func:`save_dcp`) is torch's own, with the
checkpoint's path recorded as a str, so torch's reader still reads every file and any Python reads its .metadata.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lerobot_mg.checkpoint.unpickle import archive_entries, load_byte_item, read_dcp_metadata, tensor_layout
from lerobot_mg.safe_paths import RefusedFile, contained


class _Slice(io.RawIOBase):
    """A read-only window ``[offset, offset + length)`` of an open file, seekable from its start, position or end
    (zipfile seeks from the end to find the central directory)."""

    def __init__(self, file: IO[bytes], offset: int, length: int):
        super().__init__()
        self._file, self._offset, self._length, self._pos = file, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = min(max(0, base + pos), self._length)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[: max(0, self._length - self._pos)]
        self._file.seek(self._offset + self._pos)
        count = self._file.readinto(view) or 0
        self._pos += count
        return count


@dataclass(frozen=True)
class _Stored:
    """Where a ``torch.save``d tensor's bytes are in its archive, and how they form the tensor."""

    record_offset: int
    record_size: int
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def contiguous(self) -> bool:
        expected, stride = 1, []
        for dim in reversed(self.size):
            stride.append(expected)
            expected *= dim
        return self.storage_offset == 0 and all(
            s == e for s, e, d in zip(self.stride, reversed(stride), self.size, strict=True) if d != 1)


def _stored_tensor(archive: _Slice, path: str, key: str) -> _Stored:
    """The one storage record of a ``torch.save``d tensor (its offset in the archive and size) and its layout. The
    archive's entries are checked (:func:`~lerobot_mg.checkpoint.unpickle.archive_entries`) before any is read."""
    entries = archive_entries(archive, path, key)
    records = [entry for entry in entries.values() if entry.name.rsplit("/", 2)[-2:-1] == ["data"]]
    pickles = [entry for entry in entries.values() if entry.name.endswith("/data.pkl")]
    if len(pickles) != 1:
        raise ValueError(f"expected one data.pkl, found {[entry.name for entry in pickles]}")
    archive.seek(pickles[0].offset)
    pickled = archive.read(pickles[0].size)
    dtype, offset, size, stride = tensor_layout(pickled, archive, path, key)  # refuses a pickle of anything else
    if len(records) != 1:
        raise ValueError(f"expected one storage record, found {[entry.name for entry in records]}")
    return _Stored(records[0].offset, records[0].size, dtype, offset, size, stride)


def _read_exact(file: IO[bytes], offset: int, target: torch.Tensor) -> None:
    """Fill ``target`` (uint8, contiguous, CPU) from ``file`` at ``offset``."""
    view = memoryview(target.numpy()).cast("B")
    file.seek(offset)
    done = 0
    while done < len(view):
        count = file.readinto(view[done:])
        if not count:
            raise EOFError(f"{getattr(file, 'name', file)}: ended {len(view) - done} bytes early at offset {offset + done}")
        done += count


def _resaved(value: Any) -> io.BytesIO:
    """``value`` (plain Python values and tensors, as a weights-only load returns them) as torch.save bytes: torch's
    planner unpickles byte items without the weights-only restriction, and these can hold nothing else."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous CPU tensor's memory (numpy lacks some torch dtypes, uint8 covers them all)."""
    return tensor.reshape(-1).view(torch.uint8)


class _StrPathWriter(FileSystemWriter):
    """torch's ``FileSystemWriter``, whose .metadata records the checkpoint's path as a str: torch's records the
    ``pathlib`` path it keeps, pickled under its class's module, which Python 3.13 renamed (``pathlib._local``), so
    a .metadata of 3.13 names a class that 3.10-3.12 lack."""

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if meta is not None and meta.checkpoint_id is not None:
            meta.checkpoint_id = str(meta.checkpoint_id)
        return meta


def save_dcp(state: dict[str, Any], dcp_dir: Path | str, **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` into ``dcp_dir`` with torch's writer, but no ``pathlib``
    class pickled into its .metadata (:class:`_StrPathWriter`), so it reads on every Python. ``kwargs``: dcp.save's
    (``process_group``, ``no_dist``). Collective over the process group."""
    dcp.save(state, storage_writer=_StrPathWriter(str(dcp_dir)), **kwargs)


class InPlaceFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` that never runs a checkpoint's code and reads tensors into their targets (see
    the module docstring). ``.metadata`` is read once through the allow-list of
    :func:`lerobot_mg.checkpoint.unpickle.read_dcp_metadata` (or given as ``metadata``, already read so), so torch
    never unpickles it; byte items are read with ``weights_only=True`` and handed to torch's planner re-saved from
    those plain values; planning is torch's own."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id and Path(checkpoint_id) != Path(self.path):
            self._metadata = None
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError(f"{self.path}: per-rank metadata files (__<rank>.metadata) are not read by this reader")
        if self._metadata is None:
            self._metadata = read_dcp_metadata(self.path)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        files = shard_files(self.path, {item.storage_index: self.storage_data[item.storage_index]
                                        for item in plan.items})
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            path = files[relative_path]
            with open(path, "rb", buffering=0) as file:
                # In file order, so the reads run forward through the file.
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    if info.transform_descriptors:
                        raise ValueError(f"{path}: stream transforms {info.transform_descriptors} are not supported")
                    archive = _Slice(cast(IO[bytes], file), info.offset, info.length)
                    try:
                        if item.type == LoadItemType.BYTE_IO:
                            planner.load_bytes(item, _resaved(load_byte_item(archive.read(), path,
                                                                             item.storage_index.fqn)))
                        else:
                            self._read_tensor(cast(IO[bytes], file), archive, info.offset, item, planner, str(path))
                    except RefusedFile:
                        raise
                    except Exception as error:  # say which file and entry: the archive error alone names neither
                        raise RuntimeError(f"{path}: cannot read {item.storage_index.fqn!r} at byte {info.offset:,} "
                                           f"({info.length:,} bytes): {error}") from error
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @staticmethod
    def _read_tensor(file: IO[bytes], archive: _Slice, base: int, item: ReadItem, planner: LoadPlanner,
                     path: str) -> None:
        stored = _stored_tensor(archive, path, item.storage_index.fqn)
        target = planner.resolve_tensor(item).detach()
        whole = list(item.storage_offsets) == [0] * len(stored.size) and tuple(item.lengths) == stored.size
        if (whole and target.device.type == "cpu" and target.dtype == stored.dtype and target.is_contiguous()
                and stored.contiguous and stored.record_size == target.nbytes and tuple(target.shape) == stored.size):
            _read_exact(file, base + stored.record_offset, _as_bytes(target))
        else:
            storage = torch.empty(stored.record_size, dtype=torch.uint8)
            _read_exact(file, base + stored.record_offset, storage)
            tensor = storage.view(stored.dtype).as_strided(stored.size, stored.stride, stored.storage_offset)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                tensor = tensor.narrow(dim, start, length)
            if target.shape != tensor.shape:
                raise AssertionError(f"{item.storage_index}: target {tuple(target.shape)} vs stored {tuple(tensor.shape)}")
            target.copy_(tensor)
        planner.commit_tensor(item, target)


def shard_files(dcp_dir: Path | str, storage_data: dict[MetadataIndex, Any]) -> dict[str, Path]:
    """The shard files ``storage_data`` (of ``dcp_dir``'s .metadata) places its items in, by ``relative_path``, each
    known to name a regular file inside ``dcp_dir`` (or nothing yet: a missing shard is the caller's to report).
    Raises :class:`~lerobot_mg.safe_paths.UnsafePath`, naming the item, for a path that leaves ``dcp_dir``."""
    files: dict[str, Path] = {}
    for index, info in storage_data.items():
        name = info.relative_path
        if not isinstance(name, str) or name not in files:  # contained() refuses anything but a str
            files[name] = contained(dcp_dir, name, Path(dcp_dir) / ".metadata",
                                    f"storage_data[{index.fqn!r}].relative_path",
                                    "use a checkpoint from a source you trust")
    return files


def load_dcp(state: dict[str, Any], dcp_dir: Path, metadata: Metadata | None = None, **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load`` of ``dcp_dir`` into ``state`` through :class:`InPlaceFileSystemReader`
    (``metadata``: its .metadata, already read by ``read_dcp_metadata``). A refused file (a pickle that names
    anything but checkpoint data, a compressed archive entry, a shard path out of ``dcp_dir``) raises its one-line
    :class:`~lerobot_mg.safe_paths.RefusedFile` on every rank, not torch's per-rank report of it (.metadata is read
    before torch's load starts: torch would catch the refusal and look for per-rank metadata files instead)."""
    if metadata is None:
        metadata = read_dcp_metadata(dcp_dir)
    try:
        dcp.load(state, storage_reader=InPlaceFileSystemReader(dcp_dir, metadata), **kwargs)
    except CheckpointException as error:
        refusals = [failure[0] for failure in error.failures.values() if isinstance(failure[0], RefusedFile)]
        if refusals:
            raise refusals[0] from None
        raise


def item_problems(dcp_dir: Path, metadata: Metadata, files: dict[str, Path] | None = None) -> list[str]:
    """Reads every item's pickle (not the tensor data): byte items through the weights-only load, tensor items'
    layouts through the restricted unpickler. Raises :class:`~lerobot_mg.safe_paths.RefusedFile` on a pickle that
    names anything else, a compressed or oversized archive entry, or a shard path out of ``dcp_dir``; returns the
    items that do not read (a damaged archive). The shard files must be whole (sizes checked); ``files``: their
    :func:`shard_files`, when the caller has them."""
    if files is None:
        files = shard_files(dcp_dir, metadata.storage_data)
    by_file: dict[str, list[Any]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    problems = []
    for relative_path, entries in sorted(by_file.items()):
        path = files[relative_path]
        with open(path, "rb", buffering=0) as file:
            for index, info in sorted(entries, key=lambda entry: entry[1].offset):
                archive = _Slice(cast(IO[bytes], file), info.offset, info.length)
                try:
                    if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                        load_byte_item(archive.read(), path, index.fqn)
                    else:
                        _stored_tensor(archive, str(path), index.fqn)
                except RefusedFile:
                    raise
                except Exception as error:  # a damaged archive: BadZipFile, ValueError, RuntimeError...
                    problems.append(f"{relative_path} (item {index.fqn!r} unreadable: {type(error).__name__})")
    return problems
