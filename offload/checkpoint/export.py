"""A checkpoint's weights as one state dict file, or as a Hugging Face model directory
(``offload export``)."""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, Iterator, List, Tuple

import torch

from offload.checkpoint.directory import refuse_missing
from offload.checkpoint.format import (
    CHUNK_BYTES, DTYPES, PieceReader, checked_path, numel_of, read_manifest)
from offload.config import parse_size
from offload.errors import CheckpointError
from offload.io.safetensors import INDEX_NAME, SINGLE_NAME, SafetensorsWriter


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
    """One safetensors file at ``tmp``; each name of a tied parameter gets its own bytes
    (safetensors has no aliasing)."""
    layout = [(name, DTYPES[item["dtype"]], tuple(item["shape"])) for item in items for name in item["names"]]
    _write_shard(ckpt_dir, manifest, [(name, item) for item in items for name in item["names"]], layout, tmp)


def _write_shard(ckpt_dir: str, manifest: Dict[str, Any], named: List[Tuple[str, Dict[str, Any]]],
                 layout: List[Tuple[str, torch.dtype, Tuple[int, ...]]], path: str) -> None:
    """The tensors ``named`` (name, export item) as one safetensors file at ``path``, each
    streamed from the checkpoint's files in chunks of CHUNK_BYTES."""
    reader = PieceReader(ckpt_dir, manifest["files"])
    writer = SafetensorsWriter(path, layout, metadata={"format": "pt"})
    try:
        for name, item in named:
            writer.write_parts(name, _chunks(reader, item))
        writer.finish()
    except BaseException:
        writer.abandon()
        raise
    finally:
        reader.close()


def _chunks(reader: PieceReader, item: Dict[str, Any]) -> Iterator[torch.Tensor]:
    dtype = DTYPES[item["dtype"]]
    for file_name, offset, numel, file_dtype_name in item["pieces"]:
        file_dtype = DTYPES[file_dtype_name]
        per_chunk = max(1, CHUNK_BYTES // file_dtype.itemsize)
        for done in range(0, numel, per_chunk):
            chunk = torch.empty(min(per_chunk, numel - done), dtype=file_dtype)
            reader.read(file_name, offset + done * file_dtype.itemsize, chunk)
            yield chunk.to(dtype)


def export_pretrained(ckpt_dir: str, out_dir: str, max_shard_size: "int | str" = "5GB") -> None:
    """The checkpoint's weights as a Hugging Face model directory, as
    ``Engine.save_pretrained`` writes it ([Note: weights out] in memory/weights.py):
    ``model.safetensors``, or shards of at most ``max_shard_size`` and
    ``model.safetensors.index.json``; a tied parameter under its first name only. No
    config.json (a checkpoint does not hold the model's config: copy it beside)."""
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    manifest = read_manifest(ckpt_dir)
    limit = parse_size(max_shard_size, "max_shard_size")
    if not limit:
        raise ValueError(f"max_shard_size: must be a positive size, got {max_shard_size!r}")
    named = [(item["names"][0], item) for item in _export_items(manifest)]
    shards: List[List[Tuple[str, Dict[str, Any]]]] = [[]]
    size = 0
    for name, item in named:
        nbytes = numel_of(item["shape"]) * DTYPES[item["dtype"]].itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, item))
        size += nbytes
    os.makedirs(out_dir, exist_ok=True)
    names = [SINGLE_NAME] if len(shards) == 1 else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    total = 0
    for file_name, shard in zip(names, shards):
        layout = [(name, DTYPES[item["dtype"]], tuple(item["shape"])) for name, item in shard]
        _write_shard(ckpt_dir, manifest, shard, layout, os.path.join(out_dir, file_name))
        total += sum(numel_of(item["shape"]) * DTYPES[item["dtype"]].itemsize for _, item in shard)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file_name for file_name, shard in zip(names, shards) for name, _ in shard}}
        tmp = os.path.join(out_dir, INDEX_NAME + ".partial")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(out_dir, INDEX_NAME))
