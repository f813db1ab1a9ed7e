"""A checkpoint's weights as one state dict file (``offload export``)."""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, List

import torch

from offload.checkpoint.directory import refuse_missing
from offload.checkpoint.format import (
    CHUNK_BYTES, DTYPES, PieceReader, as_bytes, checked_path, numel_of, read_manifest)
from offload.errors import CheckpointError


def export_checkpoint(ckpt_dir: str, out_path: str) -> None:
    """Write the checkpoint's weights as one state dict that ``model.load_state_dict()``
    accepts: fp32 masters for trainable parameters, saved values for frozen ones (in the
    parameter's own dtype), buffers; every key of tied parameters. A checkpoint of several
    ranks is consolidated (each parameter's pieces joined). ``out_path`` ending in
    ``.safetensors`` gives a safetensors file, anything else a ``torch.save`` file.

    Memory: the safetensors writer streams in chunks. The torch.save file is written from
    memory maps of the checkpoint files (file-backed pages, not anonymous memory), except
    parameters in several pieces or whose dtype differs from the saved one, joined or
    converted one at a time."""
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    refuse_missing(ckpt_dir, "export_checkpoint")  # [Note: atomic checkpoint directory]
    manifest = read_manifest(ckpt_dir)
    out_path = os.fspath(out_path)
    items = _export_items(manifest)
    tmp = f"{out_path}.partial-{os.getpid()}"
    try:
        if out_path.endswith(".safetensors"):
            _write_safetensors(ckpt_dir, manifest, items, tmp)
        else:
            _write_torch_save(ckpt_dir, manifest, items, tmp)
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _export_items(manifest: Dict[str, Any]) -> List[Dict[str, Any]]:
    """(names, shape, output dtype, pieces as (file, offset, numel, file dtype)) of every
    tensor to export."""
    items = []
    for u in manifest["units"]:
        for r in u["entries"]:
            key = "master" if r["trainable"] else "value"
            pieces = [(p["file"], p[key], p["numel"], "float32" if r["trainable"] else p["file_dtype"])
                      for p in r["pieces"]]
            items.append({"names": r["names"], "shape": r["shape"], "pieces": pieces,
                          "dtype": "float32" if r["trainable"] else r["dtype"]})
    for b in manifest["buffers"]:
        items.append({"names": [b["name"]], "shape": b["shape"], "dtype": b["dtype"],
                      "pieces": [("buffers.bin", b["offset"], numel_of(b["shape"]), b["dtype"])]})
    return items


def _write_torch_save(ckpt_dir: str, manifest: Dict[str, Any], items: List[Dict[str, Any]], tmp: str) -> None:
    import numpy as np

    result: Dict[str, torch.Tensor] = {}
    maps = []
    for item in items:
        dtype = DTYPES[item["dtype"]]
        parts = []
        for file_name, offset, numel, file_dtype_name in item["pieces"]:
            file_dtype = DTYPES[file_dtype_name]
            nbytes = numel * file_dtype.itemsize
            if offset + nbytes > manifest["files"][file_name]["bytes"]:
                raise CheckpointError(f"checkpoint file {file_name!r}: an entry lies outside the file")
            raw = np.memmap(checked_path(ckpt_dir, file_name), dtype=np.uint8, mode="r",
                            offset=offset, shape=(nbytes,))
            maps.append(raw)
            with warnings.catch_warnings():  # read-only map: torch warns that it is not writable
                warnings.simplefilter("ignore", UserWarning)
                parts.append(torch.from_numpy(raw).view(file_dtype))
        if not parts:
            tensor = torch.empty(item["shape"], dtype=dtype)
        elif len(parts) == 1 and parts[0].dtype == dtype:
            tensor = parts[0].view(item["shape"])
        else:
            tensor = torch.cat([part.to(dtype) for part in parts]).view(item["shape"])
        for name in item["names"]:
            result[name] = tensor
    torch.save(result, tmp)
    del result, maps


def _write_safetensors(ckpt_dir: str, manifest: Dict[str, Any], items: List[Dict[str, Any]], tmp: str) -> None:
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL"}
    header: Dict[str, Any] = {}
    position = 0
    plan = []
    for item in items:
        dtype = DTYPES[item["dtype"]]
        nbytes = numel_of(item["shape"]) * dtype.itemsize
        for name in item["names"]:  # safetensors has no aliasing: each name gets its bytes
            header[name] = {"dtype": names[dtype], "shape": item["shape"],
                            "data_offsets": [position, position + nbytes]}
            plan.append(item)
            position += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    reader = PieceReader(ckpt_dir, manifest["files"])
    try:
        with open(tmp, "wb") as out:
            out.write(len(blob).to_bytes(8, "little"))
            out.write(blob)
            for item in plan:
                dtype = DTYPES[item["dtype"]]
                for file_name, offset, numel, file_dtype_name in item["pieces"]:
                    file_dtype = DTYPES[file_dtype_name]
                    per_chunk = max(1, CHUNK_BYTES // file_dtype.itemsize)
                    for done in range(0, numel, per_chunk):
                        chunk = torch.empty(min(per_chunk, numel - done), dtype=file_dtype)
                        reader.read(file_name, offset + done * file_dtype.itemsize, chunk)
                        out.write(as_bytes(chunk.to(dtype)))
            out.flush()
            os.fsync(out.fileno())
    finally:
        reader.close()
