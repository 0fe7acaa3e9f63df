"""Every pickle a checkpoint holds, read so that nothing in it can run: the package's only unpickling.

A DCP checkpoint holds pickles in three places, and a checkpoint from someone else may hold anything there:

- ``.metadata``: torch's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on it, which runs whatever the
  pickle names (an ``os.system`` call, say). :func:`read_dcp_metadata` reads it through an allow-list of exactly
  the classes torch's DCP writer puts there (:data:`METADATA_GLOBALS`); anything else is refused with a
  :class:`RefusedPickle` that names the file and the refused ``module.name``, before it is called.
- byte items of a ``.distcp`` file (an optimizer's ``param_groups`` values): torch's load planner reads them with
  ``torch.load(weights_only=False)``. :func:`load_byte_item` reads them with ``weights_only=True``.
- tensor items of a ``.distcp`` file: a ``torch.save`` archive whose ``data.pkl`` :func:`tensor_layout` reads with an
  unpickler that resolves only the tensor rebuild function and the storage types (and ``torch.load(weights_only=True)``
  for a layout it does not know).

Before any entry of an item's ``torch.save`` archive is read, by us or by ``torch.load``, :func:`archive_entries`
checks the archive's zip directory: every entry stored uncompressed, its data within the item. torch writes them
so; a compressed entry (a zip bomb inflates a few kilobytes into gigabytes, and torch's reader would inflate it) or
one that claims more bytes than the item holds is refused in one line, nothing inflated.

The files themselves are torch's own format, unchanged: torch's reader still reads every checkpoint this package
writes.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import pickletools
import re
import struct
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata

from lerobot_mg.safe_paths import RefusedFile

_DCP_METADATA_CLASSES = (
    dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta, dcp_metadata.TensorProperties,
    dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata,
    dcp_filesystem._StorageInfo,
)
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}

# What torch's DCP writer pickles into .metadata (read off every format and layout the test suite writes: 1-process
# saves in fp32, bf16 and fp16, FSDP2 and HSDP model and optimizer shards, asynchronous saves, PEFT adapters): its
# metadata dataclasses and storage records, the memory-format enum TensorProperties encodes, torch.Size, dtypes,
# the layout lookup torch pickles a torch.layout as, and the checkpoint path StorageMeta keeps (a pathlib path
# when the save was given one).
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{(cls.__module__, cls.__qualname__): cls for cls in _DCP_METADATA_CLASSES},
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    # pathlib's classes live in pathlib up to Python 3.12 and in pathlib._local from 3.13: a checkpoint saved on
    # either reads on any. This package's own writer pickles a str (dcp_io.save_dcp); these are for checkpoints that
    # other writers, or earlier versions of this package, saved with a pathlib path.
    **{(module, name): cls for module in ("pathlib", "pathlib._local") for name, cls in (
        ("PosixPath", pathlib.PosixPath), ("PurePosixPath", pathlib.PurePosixPath),
        ("WindowsPath", pathlib.PureWindowsPath),  # a save on Windows, read on any system
        ("PureWindowsPath", pathlib.PureWindowsPath))},
    **{("torch", name): dtype for name, dtype in _DTYPES.items()},
}
# The only objects whose attributes a pickle may set (pickle's BUILD): instances of the metadata dataclasses. A BUILD
# on anything else (a class itself, an enum member) is refused.
_BUILDABLE = frozenset(_DCP_METADATA_CLASSES)


class RefusedPickle(RefusedFile):
    """A checkpoint file holds a pickle this package will not load: it names something that is not checkpoint data,
    which could run code. Nothing of the file was loaded."""


def refused(path: Path | str, what: str, name: str) -> RefusedPickle:
    """The one-line refusal of ``path``, whose ``what`` (``.metadata``, an item) names ``name``."""
    return RefusedPickle(
        f"{path}: refused to unpickle {what}: it names {name}, which a DCP checkpoint never holds and which could run "
        "code, so nothing of it was loaded or run. Fix: use a checkpoint from a source you trust (or one whose weights "
        "are safetensors: lerobot-mg-convert-dcp on a trusted machine writes them)"
    )


class _Refused(pickle.UnpicklingError):
    """What an allow-list unpickler raises: the refused ``module.name``."""


class _MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (its opcodes can be overridden, the C one's cannot) with :data:`METADATA_GLOBALS` as
    the only globals and BUILD limited to instances of the metadata dataclasses."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return METADATA_GLOBALS[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {str(pid)[:40]!r}")

    def load_build(self) -> None:
        instance = self.stack[-2]  # under the state BUILD sets
        if type(instance) not in _BUILDABLE:
            kind = type(instance)
            raise _Refused(f"the attributes of a {kind.__module__}.{kind.__qualname__}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def read_dcp_metadata(dcp_dir: Path | str) -> Metadata:
    """``dcp_dir/.metadata`` read through the allow-list. Raises :class:`RefusedPickle` on anything else,
    ``FileNotFoundError`` when it is missing, and an unpickling error (EOFError, UnpicklingError...) when it is
    truncated or not a pickle."""
    path = Path(dcp_dir) / ".metadata"
    with open(path, "rb") as file:
        try:
            metadata = _MetadataUnpickler(file).load()
        except _Refused as error:
            raise refused(path, "its contents", str(error)) from None
    if not isinstance(metadata, Metadata):
        raise refused(path, "its contents", f"a {type(metadata).__name__} instead of DCP Metadata")
    return metadata


# --- .distcp items -------------------------------------------------------------------------------------------------

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header: 30 bytes, then name and extra field
_LOCAL_HEADER_SIGNATURE = 0x04034B50
_ZIP_MAGIC = b"PK\x03\x04"  # how torch.load tells a torch.save archive from a legacy pickle


@dataclass(frozen=True)
class ArchiveEntry:
    """An entry of a ``torch.save`` archive, stored as it is: its bytes are ``[offset, offset + size)`` of the
    archive."""

    name: str
    offset: int
    size: int


def archive_refused(path: Path | str, key: str, entry: str, problem: str) -> RefusedFile:
    """The one-line refusal of the archive of item ``key`` of ``path`` whose ``entry`` has ``problem``."""
    return RefusedFile(
        f"{path}: item {key!r}: its archive entry {entry!r} {problem}; torch stores every entry of a checkpoint item "
        "uncompressed within the item, so nothing of it was inflated or read. Fix: use a checkpoint from a source you "
        "trust"
    )


def archive_entries(archive: IO[bytes], path: Path | str, key: str) -> dict[str, ArchiveEntry]:
    """The entries of ``archive`` (the ``torch.save`` archive of item ``key`` of ``path``) by name, read from its zip
    directory and local headers alone. Raises :class:`RefusedFile` for an entry that is compressed or whose data
    would end beyond the archive: nothing is inflated, and no entry can claim more memory than the file holds.
    A damaged archive raises zipfile's ``BadZipFile`` or ``ValueError``."""
    length = archive.seek(0, os.SEEK_END)
    archive.seek(0)
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
    entries = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise archive_refused(path, key, info.filename, f"is compressed (zip method {info.compress_type})")
        if info.compress_size != info.file_size:
            raise archive_refused(path, key, info.filename, f"claims {info.file_size:,} bytes stored in "
                                                            f"{info.compress_size:,}")
        if info.header_offset + _LOCAL_HEADER.size > length:
            raise archive_refused(path, key, info.filename, f"starts beyond the item's {length:,} bytes")
        archive.seek(info.header_offset)
        header = _LOCAL_HEADER.unpack(archive.read(_LOCAL_HEADER.size))
        if header[0] != _LOCAL_HEADER_SIGNATURE:
            raise ValueError(f"entry {info.filename!r}: no zip local file header at byte {info.header_offset:,}")
        if header[3] != zipfile.ZIP_STORED:
            raise archive_refused(path, key, info.filename, f"is compressed (zip method {header[3]} in its header)")
        offset = info.header_offset + _LOCAL_HEADER.size + header[-2] + header[-1]
        if offset + info.file_size > length:
            raise archive_refused(path, key, info.filename, f"claims {info.file_size:,} bytes from byte {offset:,}, "
                                                            f"beyond the item's {length:,} bytes")
        entries[info.filename] = ArchiveEntry(info.filename, offset, info.file_size)
    archive.seek(0)
    return entries


_TORCH_REFUSAL = re.compile(r"GLOBAL (\S+)|unrecognized function (\S+)|but got (<[^>]+>)")


def _global_names(pickled: bytes) -> list[str]:
    """The ``module.name`` of every global a pickle names, read off its opcodes (nothing is resolved or run): for
    the message only. STACK_GLOBAL takes its two names from the stack, tracked here as far as strings go."""
    names: list[str] = []
    below, top = None, None
    memo: dict[int, Any] = {}
    try:
        for opcode, arg, _ in pickletools.genops(pickled):
            if opcode.name == "GLOBAL":
                names.append(str(arg).replace(" ", "."))
                below, top = top, None
            elif opcode.name == "STACK_GLOBAL":
                names.append(f"{below}.{top}")
                below, top = None, None
            elif opcode.name == "MEMOIZE":
                memo[len(memo)] = top
            elif opcode.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = top
            elif opcode.name in ("GET", "BINGET", "LONG_BINGET"):
                below, top = top, memo.get(arg)
            elif opcode.name not in ("PROTO", "FRAME"):
                below, top = top, arg if isinstance(arg, str) else None
    except Exception:  # a damaged pickle: the names read so far
        pass
    return names


def _pickle_of(raw: bytes) -> bytes:
    """The pickle of a ``torch.save`` archive (its data.pkl, stored uncompressed), or ``raw`` itself (the legacy
    format, or an archive :func:`archive_entries` refuses: nothing is inflated for a message)."""
    try:
        entries = archive_entries(io.BytesIO(raw), "", "")
    except (zipfile.BadZipFile, ValueError):  # RefusedFile is a ValueError too
        return raw
    entry = next((entry for entry in entries.values() if entry.name.endswith("/data.pkl")), None)
    return raw if entry is None else raw[entry.offset:entry.offset + entry.size]


def _torch_refused_name(error: Exception, raw: bytes) -> str:
    """The ``module.name`` torch's weights-only unpickler refused: from its message, else the first global of the
    pickle it does not allow by default."""
    match = _TORCH_REFUSAL.search(str(error))
    if match:
        return next(group for group in match.groups() if group)
    names = [name for name in _global_names(_pickle_of(raw))
             if not name.startswith(("torch.", "collections.OrderedDict"))]
    return names[0] if names else "an instruction outside the weights-only unpickler's"


def load_byte_item(raw: bytes, path: Path | str, key: str) -> Any:
    """A byte item (``torch.save`` of a non-tensor value) of ``path``, read with ``weights_only=True``: plain
    Python values and tensors only. Raises :class:`RefusedPickle` naming ``key`` on anything else, and
    :class:`RefusedFile` on an archive entry :func:`archive_entries` refuses."""
    if raw.startswith(_ZIP_MAGIC):  # torch.load would inflate whatever its entries name
        archive_entries(io.BytesIO(raw), path, key)
    try:
        with warnings.catch_warnings():  # a pickle protocol above torch.save's own: refused below if it is unsafe
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise refused(path, f"item {key!r}", _torch_refused_name(error, raw)) from None


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
    rebuild function, storage types and OrderedDict resolve, and the rebuild function is a stand-in that returns
    its arguments, so nothing runs. Anything else raises."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ("storage", storage type, key, location, numel)


def tensor_layout(pickled: bytes, archive: IO[bytes], path: Path | str,
                  key: str) -> tuple[torch.dtype, int, tuple[int, ...], tuple[int, ...]]:
    """dtype, storage offset, size and stride of the tensor a ``torch.save`` archive holds, from its data.pkl;
    for a layout the fast unpickler does not know (a tensor subclass, another format), ``torch.load`` of the
    ``archive`` to the meta device with ``weights_only=True`` (whose entries the caller has checked with
    :func:`archive_entries`). Raises :class:`RefusedPickle` naming ``key`` when neither accepts it."""
    try:
        (_, dtype, *_), offset, size, stride = _TensorLayoutUnpickler(io.BytesIO(pickled)).load()
        return dtype, offset, size, stride
    except (pickle.UnpicklingError, TypeError, ValueError) as error:
        first_refusal = str(error) if isinstance(error, _Refused) else None
    archive.seek(0)
    try:
        meta = torch.load(archive, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as error:
        raise refused(path, f"item {key!r}", first_refusal or _torch_refused_name(error, pickled)) from None
    if not isinstance(meta, torch.Tensor):
        raise refused(path, f"item {key!r}", f"a {type(meta).__name__} where a tensor is stored")
    return meta.dtype, meta.storage_offset(), tuple(meta.shape), tuple(meta.stride())
