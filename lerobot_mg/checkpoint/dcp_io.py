"""Reading DCP shards at file speed, without changing their format.

torch's ``FileSystemReader`` stores each tensor as a ``torch.save`` archive inside a ``.distcp`` file and loads it
with ``torch.load`` into fresh memory, then copies it into the target tensor: two passes over every byte plus the
archive's bookkeeping (6.4x a plain read of the same bytes, scripts/bench_dcp.py). :class:`InPlaceFileSystemReader`
reads the same files: it reads the tensor's dtype, shape and strides from the archive's data.pkl (a restricted C
unpickler; ``torch.load(map_location="meta")`` for anything it does not know), finds the data record in the zip
directory, and ``readinto``s it straight into the target
tensor when the target is a whole, contiguous CPU tensor of the stored dtype (the common case: a resume on the
topology that saved). Anything else (a resharded slice, a GPU target, another dtype) is read once into a CPU buffer
and copied. The writer is torch's own, so torch's reader (and ``lerobot-mg-convert-dcp``) still reads every file.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import warnings
import zipfile
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header: 30 bytes, then name and extra field
_LOCAL_HEADER_SIGNATURE = 0x04034B50


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


def _storage_dtypes() -> dict[str, torch.dtype]:
    """The typed storage class names torch.save pickles (FloatStorage, BFloat16Storage, ...) -> their dtype."""
    with warnings.catch_warnings():  # reading `.dtype` of a TypedStorage class warns that TypedStorage is deprecated
        warnings.simplefilter("ignore")
        return {name: getattr(torch, name).dtype for name in dir(torch)
                if name.endswith("Storage") and name not in ("Storage", "UntypedStorage", "TypedStorage")
                and isinstance(getattr(torch, name), type) and isinstance(getattr(getattr(torch, name), "dtype", None),
                                                                           torch.dtype)}


_STORAGE_DTYPES = _storage_dtypes()


class _TensorLayoutUnpickler(pickle.Unpickler):
    """Reads the layout of a plain tensor from a ``torch.save`` archive's data.pkl with the C unpickler: only the
    rebuild function, storage types and OrderedDict resolve, nothing runs. Anything else (a tensor subclass, a
    format this code does not know) raises, and the caller asks torch.load instead."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ("storage", storage type, key, location, numel)


def _stored_tensor(archive: _Slice) -> _Stored:
    """The one storage record of a ``torch.save``d tensor (its offset in the archive and size) and its layout."""
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        records = [info for info in infos if info.filename.rsplit("/", 2)[-2:-1] == ["data"]]
        if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"expected one uncompressed storage record, found {[r.filename for r in records]}")
        record = records[0]
        pickled = zf.read(next(info for info in infos if info.filename.endswith("/data.pkl")))
    try:
        (_, dtype, *_), offset, size, stride = _TensorLayoutUnpickler(io.BytesIO(pickled)).load()
    except (pickle.UnpicklingError, TypeError, ValueError):
        archive.seek(0)
        meta = cast(torch.Tensor, torch.load(archive, map_location="meta", weights_only=True))
        dtype, offset, size, stride = meta.dtype, meta.storage_offset(), tuple(meta.shape), meta.stride()
    archive.seek(record.header_offset)
    header = _LOCAL_HEADER.unpack(archive.read(_LOCAL_HEADER.size))
    if header[0] != _LOCAL_HEADER_SIGNATURE:
        raise ValueError("not a zip local file header")
    name_length, extra_length = header[-2], header[-1]
    record_offset = record.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    return _Stored(record_offset, record.file_size, dtype, offset, size, stride)


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


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous CPU tensor's memory (numpy lacks some torch dtypes, uint8 covers them all)."""
    return tensor.reshape(-1).view(torch.uint8)


class InPlaceFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` with a ``read_data`` that reads tensors into their targets (see the module
    docstring). Metadata, planning and byte items are torch's own."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            path = self.fs.concat_path(self.path, relative_path)
            with open(path, "rb", buffering=0) as file:
                # In file order, so the reads run forward through the file.
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    info = self.storage_data[item.storage_index]
                    if info.transform_descriptors:
                        raise ValueError(f"{path}: stream transforms {info.transform_descriptors} are not supported")
                    archive = _Slice(cast(IO[bytes], file), info.offset, info.length)
                    try:
                        if item.type == LoadItemType.BYTE_IO:
                            planner.load_bytes(item, io.BytesIO(archive.read()))
                        else:
                            self._read_tensor(cast(IO[bytes], file), archive, info.offset, item, planner)
                    except Exception as error:  # say which file and entry: the archive error alone names neither
                        raise RuntimeError(f"{path}: cannot read {item.storage_index.fqn!r} at byte {info.offset:,} "
                                           f"({info.length:,} bytes): {error}") from error
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @staticmethod
    def _read_tensor(file: IO[bytes], archive: _Slice, base: int, item: ReadItem, planner: LoadPlanner) -> None:
        stored = _stored_tensor(archive)
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
