"""The safetensors file format, read and written a tensor at a time, without the
``safetensors`` package: weights in (``wrap(..., weights=PATH)``) and out
(``Engine.save_pretrained``) in the format Hugging Face ships models in.

A file is an 8-byte little-endian header length N, N bytes of JSON (for each tensor its
``dtype``, ``shape`` and ``data_offsets`` [begin, end) into the data that follows; an
optional ``__metadata__`` of strings), then the tensors' bytes, C order, little-endian. A
sharded model has ``model.safetensors.index.json``: ``{"metadata": {...}, "weight_map":
{name: file}}``.

Reads go through ``pread`` into a buffer of that one tensor (no memory map): the page cache
may keep the file, the process does not, so loading a model bigger than RAM holds one
tensor at a time. Every header is checked when a file is opened (sizes, offsets inside the
file, no overlaps past the data, known dtypes); a bad one is a ValueError naming the file
and the tensor.
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["SafetensorsFile", "SafetensorsWriter", "WeightFiles", "DTYPES", "INDEX_NAME", "SINGLE_NAME"]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 << 20  # the reference implementation's limit

DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAME_OF = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsFile:
    """One .safetensors file: its checked header, and ``read(name)`` of one tensor."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            raise ValueError(f"weights: cannot open {path!r}: {error.strerror}") from error
        try:
            self.entries, self.metadata, self._data_start = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _bad(self, why: str) -> ValueError:
        return ValueError(f"weights: {self.path!r} is not a valid safetensors file: {why}")

    def _read_header(self) -> Tuple[Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]], Dict[str, str], int]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._bad("shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise self._bad(f"header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(os.pread(self._fd, n, 8).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._bad(f"its header is not JSON ({error})") from None
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._bad("__metadata__ must map strings to strings")
        data_bytes = size - 8 - n
        entries = {}
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(info["shape"])
                begin, end = info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"tensor {name!r} needs a known dtype ({sorted(DTYPES)}), a shape "
                                f"and data_offsets, got {info!r}") from None
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) or \
                    not all(isinstance(o, int) and not isinstance(o, bool) for o in (begin, end)):
                raise self._bad(f"tensor {name!r}: shape and data_offsets must be non-negative ints")
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            if not 0 <= begin <= end <= data_bytes or end - begin != nbytes:
                raise self._bad(f"tensor {name!r}: data_offsets [{begin}, {end}) do not hold {shape} "
                                f"{info['dtype']} ({nbytes} bytes) inside the {data_bytes} data bytes")
            entries[name] = (dtype, shape, begin, end)
        return entries, metadata, 8 + n

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name``, in a buffer of its own (the file is not kept mapped)."""
        dtype, shape, begin, end = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy()) if out.numel() else memoryview(b"")
        done = 0
        while done < end - begin:
            got = os.preadv(self._fd, [view[done:]], self._data_start + begin + done)
            if got <= 0:
                raise OSError(f"weights: {self.path!r} ended inside tensor {name!r}")
            done += got
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class WeightFiles:
    """The weights of one model: a Hugging Face model directory (``model.safetensors``, or
    ``model.safetensors.index.json`` and its shards) or a single ``.safetensors`` file. Local
    paths only; nothing is downloaded. ``shapes`` maps every tensor name to (dtype, shape)."""

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        path = os.fspath(path)
        self.path = path
        if os.path.isdir(path):
            index, single = os.path.join(path, INDEX_NAME), os.path.join(path, SINGLE_NAME)
            if os.path.isfile(index):
                names = self._shards_of(index)
            elif os.path.isfile(single):
                names = {SINGLE_NAME: None}
            else:
                raise ValueError(f"weights: {path!r} holds neither {SINGLE_NAME} nor {INDEX_NAME} (only "
                                 "safetensors weights are read; nothing is downloaded)")
            files = [os.path.join(path, name) for name in names]
        elif os.path.isfile(path) and path.endswith(".safetensors"):
            files = [path]
        else:
            raise ValueError(f"weights: {path!r} is neither a model directory nor a .safetensors file "
                             "(local paths only; nothing is downloaded)")
        self._files: List[SafetensorsFile] = []
        self._file_of: Dict[str, SafetensorsFile] = {}
        try:
            for f in files:
                st = SafetensorsFile(f)
                self._files.append(st)
                for name in st.entries:
                    if name in self._file_of:
                        raise ValueError(f"weights: tensor {name!r} is in both {self._file_of[name].path!r} "
                                         f"and {f!r}")
                    self._file_of[name] = st
        except BaseException:
            self.close()
            raise
        self.shapes: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]] = {
            name: st.entries[name][:2] for name, st in self._file_of.items()}

    def _shards_of(self, index: str) -> Dict[str, None]:
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            shards = dict.fromkeys(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"weights: {index!r} is not a safetensors index with a weight_map ({error})") from None
        for shard in shards:
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise ValueError(f"weights: {index!r} names shard {shard!r}, not a file beside it")
        return shards

    def read(self, name: str) -> torch.Tensor:
        return self._file_of[name].read(name)

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> "WeightFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SafetensorsWriter:
    """Writes one .safetensors file whose tensors are known up front (``layout``: name,
    dtype, shape, in file order) and whose values come a tensor at a time through
    ``write(name, tensor)``, in that order. The file appears at ``path`` only on
    ``finish()`` (written as ``path.partial`` first, fsynced, renamed)."""

    def __init__(self, path: str, layout: Iterable[Tuple[str, torch.dtype, Tuple[int, ...]]],
                 metadata: Optional[Dict[str, str]] = None) -> None:
        self.path = path
        header: Dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        self._order: List[Tuple[str, torch.dtype, Tuple[int, ...], int]] = []
        offset = 0
        for name, dtype, shape in layout:
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            header[name] = {"dtype": _NAME_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        self.data_bytes = offset
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        self._next = 0
        self._file = open(path + ".partial", "wb")
        self._file.write(len(text).to_bytes(8, "little") + text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, dtype, shape, nbytes = self._order[self._next]
        if name != want or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"safetensors writer: expected {want!r} {shape} {dtype}, got {name!r} "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
        self.write_parts(name, [tensor])

    def write_parts(self, name: str, parts: Iterable[torch.Tensor]) -> None:
        """Tensor ``name`` as consecutive flat parts of its dtype (a big tensor streamed in
        chunks); their bytes must add up to the tensor's."""
        want, dtype, shape, nbytes = self._order[self._next]
        if name != want:
            raise ValueError(f"safetensors writer: expected {want!r}, got {name!r}")
        written = 0
        for part in parts:
            if part.dtype != dtype:
                raise ValueError(f"safetensors writer: {name!r} is {dtype}, got a part in {part.dtype}")
            data = part.detach().to("cpu").contiguous().reshape(-1)
            if data.numel():
                self._file.write(memoryview(data.view(torch.uint8).numpy()))
            written += data.numel() * data.element_size()
        if written != nbytes:
            raise ValueError(f"safetensors writer: {name!r} needs {nbytes} bytes, got {written}")
        self._next += 1

    def finish(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"safetensors writer: {len(self._order) - self._next} tensors of {self.path!r} "
                             "were never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.path + ".partial", self.path)

    def abandon(self) -> None:
        """Stop and remove the partial file."""
        self._file.close()
        try:
            os.unlink(self.path + ".partial")
        except FileNotFoundError:
            pass
