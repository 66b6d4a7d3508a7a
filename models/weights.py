"""Stream HF safetensors checkpoints onto the mesh by a model class's weight map
(models/base.py), one device shard at a time (docs/design.md §5, "Loading").

Every param is a ``jax.make_array_from_callback`` whose callback reads only the index
range that device holds, layer by layer for stacked params, transposes, pads or
replicates it (models/sharding.py: ``source_indices``) and casts it to the serving
dtype. Host memory therefore peaks near one param's shards, never the model; in a
multi-controller run each process reads only its own devices' shards.

The files are read with positioned reads (os.preadv), not mmap: the pages of a mapped
file count in the process's RSS for as long as it stays mapped, and reading a whole
checkpoint through one open ``safe_open`` handle grows RSS by the file's size.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from models import packed_formats
from models.quantization import checkpoint_weight_map
from models.base import Weight, dim_size
from models.config import ModelArchConfig
from models.sharding import checkpoint_arch, source_indices

# The safetensors dtype names (its format spec) that a weight may have.
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
# Reading a column range of a tensor goes through a scratch buffer of whole rows this big.
_SCRATCH_BYTES = 16 << 20


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / f for f in files]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


@dataclass(frozen=True)
class TensorInfo:
    path: Path
    dtype: str  # safetensors dtype name ("F32", "BF16", ...)
    shape: tuple[int, ...]
    offset: int  # file offset of the first byte


def _read_into(fd: int, buf: np.ndarray, offset: int) -> None:
    """Fill the C-contiguous ``buf`` with the file's bytes from ``offset``."""
    view = memoryview(buf.reshape(-1).view(np.uint8))  # uint8 view: ml_dtypes have no buffer format
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n


# Checkpoint name prefixes read as another: the Hub's SigLIP towers (Gemma 3) nest their
# tensors in ``vision_tower.vision_model.``, which transformers 5 writes without the
# ``vision_model.`` (models/gemma3_vl.py names them so).
_NAME_ALIASES = (("vision_tower.vision_model.", "vision_tower."),)


def _canonical_name(name: str) -> str:
    for prefix, canonical in _NAME_ALIASES:
        if name.startswith(prefix):
            return canonical + name[len(prefix):]
    return name


class SafetensorsCheckpoint:
    """The tensors of a folder's safetensors files by name; ``read`` returns one index
    range of a tensor. Only the headers are read up front.

    Packed formats (MXFP4, AWQ, GPTQ, W4A16, fp8 blocks: models/packed_formats.py) are seen as the float
    tensors HF's dequantized model holds: their parts leave ``tensors`` and the tensor
    they decode to takes their place, decoded when it is read."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in _safetensors_files(self.model_dir):
            with open(path, "rb") as f:
                # Format: u64 little-endian header size, a JSON header, then the raw data.
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, t in header.items():
                if name != "__metadata__":
                    name = _canonical_name(name)
                    self.tensors[name] = TensorInfo(path, t["dtype"], tuple(t["shape"]), 8 + size + t["data_offsets"][0])
        self.packed: dict[str, tuple[str, dict[str, TensorInfo]]] = {}  # name -> (format, its parts)
        self.views: dict[str, tuple[str, str]] = {}  # add_code_views: view name -> (float view, part)
        config = self.model_dir / "config.json"
        qc = json.loads(config.read_text()).get("quantization_config") if config.exists() else None
        self._find_packed(packed_formats.packed_method(qc), qc or {})

    def _find_packed(self, method: str | None, qc: dict) -> None:
        def take(fmt: str, name: str, parts: dict[str, str], dtype: str, shape: tuple[int, ...]) -> None:
            infos = {k: self.tensors.pop(v) for k, v in parts.items()}
            self.packed[name] = (fmt, infos)
            self.tensors[name] = TensorInfo(infos["main"].path, dtype, shape, -1)

        for name in [n for n in self.tensors if n.endswith("_blocks")]:  # MXFP4 pairs: found by their headers
            base, blocks = name[:-len("_blocks")], self.tensors[name]
            scales = self.tensors.get(base + "_scales")
            if (scales is None or blocks.dtype != "U8" or scales.dtype != "U8" or len(blocks.shape) < 3
                    or blocks.shape[-1] * 2 != packed_formats.MXFP4_BLOCK or scales.shape != blocks.shape[:-1]):
                continue
            *prefix, rows, groups, _ = blocks.shape
            take("mxfp4", base, {"main": name, "scales": base + "_scales"}, "BF16",
                 (*prefix, groups * packed_formats.MXFP4_BLOCK, rows))
        if method in ("awq", "gptq"):
            for name in [n for n in self.tensors if n.endswith(".qweight")]:
                base = name[:-len(".qweight")]
                parts = {"main": name, "zeros": base + ".qzeros", "scales": base + ".scales"}
                if method == "gptq" and base + ".g_idx" in self.tensors:
                    parts["g_idx"] = base + ".g_idx"
                if any(p not in self.tensors for p in parts.values()):
                    raise ValueError(f"{self.model_dir}: {method} tensor {name} comes without "
                                     f"{', '.join(p for p in parts.values() if p not in self.tensors)}")
                rows, cols = self.tensors[name].shape
                shape = (cols * 8, rows) if method == "awq" else (cols, rows * 8)  # [out, in]
                # float32: (q - z) * s is exact there, whatever the scales' dtype.
                take(method, base + ".weight", parts, "F32", shape)
        elif method == "fp8":  # block-scaled (DeepSeek-V3): each X.weight with its X.weight_scale_inv
            for name in [n for n in self.tensors if n.endswith(".weight_scale_inv")]:
                base = name[:-len("_scale_inv")]
                if self.tensors.get(base) is None or self.tensors[base].dtype != "F8_E4M3":
                    raise ValueError(f"{self.model_dir}: fp8 scale {name} comes without an F8_E4M3 {base}")
                take(method, base, {"main": base, "scales": name}, "F32", self.tensors[base].shape)
        elif method == packed_formats.PACK_QUANTIZED:
            for name in [n for n in self.tensors if n.endswith(".weight_packed")]:
                base = name[:-len(".weight_packed")]
                parts = {"main": name, "scales": base + ".weight_scale"}
                if base + ".weight_shape" in self.tensors:
                    parts["shape"] = base + ".weight_shape"
                rows, cols = self.tensors[name].shape
                take(method, base + ".weight", parts, "F32", (rows, cols * 8))
        self.packed_options = dict(block=qc.get("weight_block_size"),
                                   zero_offset=0 if qc.get("checkpoint_format") == "gptq_v2" else 1)

    def dtype(self, name: str) -> np.dtype:
        info = self.tensors[name]
        if info.dtype not in _DTYPES:
            raise ValueError(f"{info.path}: tensor {name!r} has dtype {info.dtype}, which is not supported")
        return np.dtype(_DTYPES[info.dtype])

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The tensor's ``index`` (one step-1 slice per axis) in its stored dtype. Rows
        (axis 0) are read as one range; a narrower range of the other axes goes through a
        scratch buffer of whole rows."""
        self.dtype(name)  # a clear error for a dtype no param may have
        if name in self.views:
            return self._read_code_view(*self.views[name], index)
        if name in self.packed:
            return self._read_packed(name, index)
        return self._read(self.tensors[name], index)

    def _whole(self, name: str, part: str) -> np.ndarray:
        """The whole stored tensor ``part`` of packed tensor ``name``."""
        info = self.packed[name][1][part]
        return self._read(info, tuple(slice(None) for _ in info.shape))

    def _int4_codes(self, name: str) -> np.ndarray:
        """uint8 [out, in]: the codes of int4 projection ``name`` (its float view's name)."""
        fmt, parts = self.packed[name]
        if fmt == "awq":
            return packed_formats.awq_codes(self._whole(name, "main"))
        if fmt == "gptq":
            return packed_formats.gptq_codes(self._whole(name, "main"))
        return packed_formats.pack_quantized_codes(self._whole(name, "main"),
                                                   self._whole(name, "shape") if "shape" in parts else None)

    def _int4_groups(self, name: str):
        """(zeros [out, G], scales [out, G], g_idx [in] or None) of int4 projection ``name``:
        its small tensors only."""
        fmt, parts = self.packed[name]
        if fmt == "awq":
            return packed_formats.awq_groups(self._whole(name, "zeros"), self._whole(name, "scales"))
        if fmt == "gptq":
            return packed_formats.gptq_groups(self._whole(name, "zeros"), self._whole(name, "scales"),
                                              self._whole(name, "g_idx") if "g_idx" in parts else None,
                                              self.packed_options["zero_offset"])
        return packed_formats.pack_quantized_groups(self._whole(name, "scales"))

    def _grouped_projections(self):
        """(float view name, group count G, input rows) of each projection that can be kept
        as stored (packed_formats.KEPT_KIND), from the headers. An fp8 projection whose
        input rows are no whole number of blocks (a tiny model's) is left out: it is
        served decoded."""
        for name, (fmt, parts) in self.packed.items():
            if fmt == "mxfp4":  # [..., R, G, 16] blocks: the view is [..., G * 32, R]
                yield name, parts["scales"].shape[-1], self.tensors[name].shape[-2]
            elif fmt == "fp8":  # [out, in] with scales [ceil(out / b0), ceil(in / b1)]
                n_in = self.tensors[name].shape[1]
                if n_in % self.packed_options["block"][1] == 0:
                    yield name, parts["scales"].shape[1], n_in
            else:
                groups = parts["scales"].shape[1 if fmt == packed_formats.PACK_QUANTIZED else 0]
                yield name, groups, self.tensors[name].shape[1]

    def group_layout(self) -> tuple[int, bool]:
        """(group size, act-order) shared by the checkpoint's packed projections: the group
        size 0 for one scale per output row (channel), act-order when some GPTQ tensor's
        groups are out of order. ValueError when projections disagree on the group size."""
        sizes, act_order, single = set(), False, set()
        for name, groups, n_in in self._grouped_projections():
            if groups == 1:
                single.add(n_in)  # one group: per channel, or a group of exactly its rows (an expert's down_proj)
            else:
                sizes.add(n_in // groups)
            parts = self.packed[name][1]
            act_order |= "g_idx" in parts and not packed_formats.in_order(self._whole(name, "g_idx"), groups)
        if single - sizes:  # a one-group projection whose rows are not one group of the others' size
            sizes.add(0)
        if len(sizes) > 1:
            raise ValueError(f"{self.model_dir}: the packed projections have different group sizes {sorted(sizes)}")
        return (sizes.pop() if sizes else 0), act_order

    def add_code_views(self, act_order: bool) -> None:
        """Beside each packed projection's float view ``X`` (``_grouped_projections``),
        its parts as tensors of their own, laid out as the view (HF Linear [out, in], or
        MXFP4's [..., in, out]), for a model served with the weights kept as stored
        (models/quantization.py): ``X#codes`` (int4 / e2m1 codes uint8, or the fp8
        values), ``X#scales`` (float32, one per group of input rows and output row),
        for int4 ``X#zeros`` (the same) and, with ``act_order``, ``X#gidx`` (int32
        [in], each input row's group). Each view reads only its own stored tensors."""
        for name, groups, _ in list(self._grouped_projections()):
            fmt = self.packed[name][0]
            shape = self.tensors[name].shape
            if fmt == "mxfp4":
                group_shape = (*shape[:-2], groups, shape[-1])
                views = {"codes": ("U8", shape), "scales": ("F32", group_shape)}
            else:
                views = {"codes": ("F8_E4M3" if fmt == "fp8" else "U8", shape), "scales": ("F32", (shape[0], groups))}
            if fmt in packed_formats.INT4_FORMATS:
                views["zeros"] = ("F32", (shape[0], groups))
                if act_order:
                    views["gidx"] = ("I32", (shape[1],))
            for view, (dtype, view_shape) in views.items():
                self.tensors[f"{name}#{view}"] = TensorInfo(self.tensors[name].path, dtype, view_shape, -1)
                self.views[f"{name}#{view}"] = (name, view)

    def _read_code_view(self, base: str, view: str, index: tuple[slice, ...]) -> np.ndarray:
        fmt = self.packed[base][0]
        if fmt == "mxfp4":
            return self._read_mxfp4(base, index, view)
        if fmt == "fp8":
            if view == "codes":
                return self._whole(base, "main")[index]
            scales = packed_formats.fp8_group_scales(self._whole(base, "scales"), self.packed_options["block"],
                                                     self.tensors[base].shape[0])
            return scales[index]
        if view == "codes":
            return self._int4_codes(base)[index]
        zeros, scales, g_idx = self._int4_groups(base)
        if view == "gidx":
            return packed_formats.row_groups(g_idx, self.tensors[base].shape[1], scales.shape[1]).astype(np.int32)[index]
        return (zeros if view == "zeros" else scales)[index]

    def _read_packed(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``index`` of a packed tensor, decoded (models/packed_formats.py) into its dtype."""
        fmt, parts = self.packed[name]
        if fmt == "mxfp4":
            return self._read_mxfp4(name, index, "values")
        if fmt == "fp8":  # one [out, in] projection: decoded whole, then cut
            w = packed_formats.decode_fp8_block(self._whole(name, "main"), self._whole(name, "scales"),
                                                self.packed_options["block"])
        else:
            w = packed_formats.Int4Parts(self._int4_codes(name), *self._int4_groups(name)).decode()
        return w[index].astype(np.dtype(_DTYPES[self.tensors[name].dtype]))

    def _read_mxfp4(self, name: str, index: tuple[slice, ...], part: str) -> np.ndarray:
        """``index`` of MXFP4 tensor ``name``'s ``part``: "values" (the float view [..., D,
        R]), "codes" (uint8 e2m1 codes, the same layout) or "scales" (float32 [..., D /
        32, R]). One leading index (an expert) at a time, and only the 32-value groups that
        cover the D range (the float32 decode of a whole layer's experts would be 8x the
        packed bytes)."""
        parts = self.packed[name][1]
        view = name if part == "values" else f"{name}#{part}"
        info = self.tensors[view]
        bounds = [sl.indices(n)[:2] for sl, n in zip(index, info.shape)]
        *prefix, (d0, d1), (r0, r1) = bounds
        block = packed_formats.MXFP4_BLOCK
        g0, g1 = (d0, d1) if part == "scales" else (d0 // block, -(-d1 // block))
        first = 0 if part == "scales" else g0 * block  # the first row the read groups hold
        out = np.empty((*(b - a for a, b in prefix), d1 - d0, r1 - r0), np.dtype(_DTYPES[info.dtype]))
        for idx in itertools.product(*(range(a, b) for a, b in prefix)):
            lead = tuple(slice(i, i + 1) for i in idx)
            at = (0,) * len(idx)
            read = lambda p, *rest: self._read(parts[p], lead + (slice(r0, r1), slice(g0, g1)) + rest)[at]
            if part == "scales":
                tile = packed_formats.mxfp4_scales(read("scales"))
            elif part == "codes":
                tile = packed_formats.mxfp4_codes(read("main", slice(None)))
            else:
                tile = packed_formats.decode_mxfp4(read("main", slice(None)), read("scales"))
            # [R, D] -> [D, R]; the values are exact in bf16 (2-bit mantissas).
            out[tuple(i - a for i, (a, _) in zip(idx, prefix))] = tile[:, d0 - first:d1 - first].T
        return out

    def _read(self, info: TensorInfo, index: tuple[slice, ...]) -> np.ndarray:
        dtype = np.dtype(_DTYPES[info.dtype])
        bounds = [sl.indices(n)[:2] for sl, n in zip(index, info.shape)]
        if not info.shape:
            out = np.empty((), dtype)
            with open(info.path, "rb") as f:
                _read_into(f.fileno(), out, info.offset)
            return out
        (r0, r1), rest = bounds[0], bounds[1:]
        row_shape = info.shape[1:]
        row_bytes = math.prod(row_shape) * dtype.itemsize
        full_rows = all(b == (0, n) for b, n in zip(rest, row_shape))
        out = np.empty((r1 - r0, *(b - a for a, b in rest)), dtype)
        with open(info.path, "rb") as f:
            fd = f.fileno()
            if full_rows:
                _read_into(fd, out, info.offset + r0 * row_bytes)
                return out
            cols = tuple(slice(a, b) for a, b in rest)
            step = max(1, _SCRATCH_BYTES // max(row_bytes, 1))
            scratch = np.empty((min(step, r1 - r0), *row_shape), dtype)
            for r in range(r0, r1, step):
                n = min(step, r1 - r)
                _read_into(fd, scratch[:n], info.offset + r * row_bytes)
                out[r - r0:r - r0 + n] = scratch[:n][(slice(None), *cols)]
        return out


def _span(indices: np.ndarray) -> slice | None:
    """``indices`` as a slice when they are consecutive, else None."""
    if len(indices) and indices[-1] - indices[0] == len(indices) - 1 and np.all(np.diff(indices) == 1):
        return slice(int(indices[0]), int(indices[-1]) + 1)
    return None


class _ShardReader:
    """The callback of one param's make_array_from_callback: global index -> that shard,
    read from the checkpoint in the checkpoint's layout (tp=1, [out, in] where the
    Weight transposes) and laid out as served. Equal indices (devices holding the same
    shard) are read once."""

    def __init__(self, ckpt: SafetensorsCheckpoint, weight: Weight, arch: ModelArchConfig, dtype,
                 layers: tuple[int, ...] | None = None) -> None:
        """``layers``: read only these layers of a stacked param (``arch`` then counts
        len(layers) layers): stacked index k is checkpoint layer layers[k]."""
        self.ckpt, self.weight, self.arch, self.dtype = ckpt, weight, arch, np.dtype(dtype)
        self.layers = layers
        self.shape = weight.shape(arch)
        self.cache: dict[tuple, np.ndarray] = {}

    def __call__(self, index: tuple[slice, ...]) -> np.ndarray:
        bounds = tuple(sl.indices(n)[:2] for sl, n in zip(index, self.shape))
        if bounds not in self.cache:
            self.cache[bounds] = self._read(bounds)
        return self.cache[bounds]

    def _read(self, bounds) -> np.ndarray:
        w = self.weight
        out = np.zeros([b - a for a, b in bounds], self.dtype)  # padding stays zero
        ns = len(w.stacked)  # leading axes stacked from many checkpoint tensors
        dims, axes = w.dims[ns:], bounds[ns:]
        src = [source_indices(d, self.arch, a, b) for d, (a, b) in zip(dims, axes)]
        where = [np.flatnonzero(s >= 0) for s in src]  # positions in the shard that hold data
        if any(len(p) == 0 for p in where):
            return out
        wanted = [s[p] for s, p in zip(src, where)]  # checkpoint indices, ascending
        ck_index = [slice(int(v[0]), int(v[-1]) + 1) for v in wanted]
        # Replicated KV heads: the checkpoint range is read once, then repeated by take.
        gathers = [(axis, v - v[0]) for axis, v in enumerate(wanted) if _span(v) is None]
        spans = [_span(p) for p in where]
        dst = tuple(spans) if all(s is not None for s in spans) else np.ix_(*where)
        if w.transpose:
            ck_index = ck_index[::-1]
        fused = 0 if w.transpose else len(ck_index) - 1  # the checkpoint's output axis
        if w.row_offset is not None:  # our rows are a block (or a stride) of a fused tensor's
            off, k = dim_size(checkpoint_arch(self.arch), w.row_offset), w.fused_stride
            a, b = ck_index[fused].start, ck_index[fused].stop
            # Read the span that holds them, keep every k-th row.
            ck_index[fused] = slice(a * k + off, (b - 1) * k + off + 1)
        for idx in itertools.product(*(range(a, b) for a, b in bounds[:ns])):
            names = idx if self.layers is None else (self.layers[idx[0]], *idx[1:])
            data = self.ckpt.read(w.tensor_name(self.arch, names), tuple(ck_index))
            if w.fused_stride > 1:
                data = data[(slice(None),) * fused + (slice(None, None, w.fused_stride),)]
            if w.transpose:
                data = data.T
            for axis, rel in gathers:
                data = np.take(data, rel, axis=axis)
            at = tuple(i - a for i, (a, _) in zip(idx, bounds))
            out[at][dst] = data  # the cast to the serving dtype
        return out


def checkpoint_tensors(arch: ModelArchConfig,
                       model_cls) -> dict[str, list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """Every checkpoint tensor the model reads: HF name -> [(our param name, its index on
    the param's stacked axes, the shape the checkpoint stores it in)], one entry per
    param that reads it (several for a fused tensor)."""
    stored = checkpoint_arch(arch)
    out: dict[str, list] = {}
    for param, w in checkpoint_weight_map(model_cls, stored).items():
        want = w.shape(stored)[len(w.stacked):]
        want = tuple(want[::-1] if w.transpose else want)
        if w.fused_rows is not None:  # the output axis: first when transposed, else last
            rows = dim_size(stored, w.fused_rows)
            want = (rows, *want[1:]) if w.transpose else (*want[:-1], rows)
        for idx, name in w.tensor_names(stored):
            out.setdefault(name, []).append((param, idx, want))
    return out


def ignored_tensors(arch: ModelArchConfig, model_cls, extra_ignored: tuple[str, ...] = ()) -> re.Pattern:
    """The checkpoint tensors that may stay unread (the model's harmless extras: saved
    rotary buffers, a tied lm_head copy; plus ``extra_ignored``), as one pattern."""
    regexes = model_cls.ignored_hf_tensors(checkpoint_arch(arch)) + extra_ignored
    return re.compile("|".join(f"(?:{r})" for r in regexes) or "(?!)")


def check_checkpoint_names(ckpt: SafetensorsCheckpoint, arch: ModelArchConfig, model_cls,
                           extra_ignored: tuple[str, ...] = ()) -> None:
    """Every tensor the model needs is there with the expected shape, and no other
    tensor is left over (the model lists the harmless ones: saved rotary buffers, a
    tied lm_head copy): a leftover means the checkpoint does math this decoder would
    skip. Reads the headers only."""
    ignored = ignored_tensors(arch, model_cls, extra_ignored)
    used = set()
    for name, uses in checkpoint_tensors(arch, model_cls).items():
        want = uses[0][2]
        if name not in ckpt.tensors:
            raise ValueError(f"{ckpt.model_dir}: the checkpoint has no tensor {name!r}, "
                             f"which {arch.architecture} needs")
        if ckpt.tensors[name].shape != want:
            raise ValueError(f"{ckpt.model_dir}: tensor {name!r} has shape {ckpt.tensors[name].shape}; "
                             f"config.json implies {want}")
        used.add(name)
    # A packed projection's float view and its parts (add_code_views) are one tensor: either read uses it.
    used_bases = {n.split("#")[0] for n in used}
    unused = sorted(n for n in ckpt.tensors
                    if n not in used and n.split("#")[0] not in used_bases and not ignored.fullmatch(n))
    if unused:
        raise ValueError(f"{ckpt.model_dir}: {len(unused)} checkpoint tensor(s) that {arch.architecture} as "
                         f"configured does not use, e.g. {unused[:3]}; this model variant is not supported")


def stream_safetensors(model_dir: str | Path, arch: ModelArchConfig, model_cls, mesh: Mesh, dtype, *,
                       progress: bool = True, transform=None, param_dtypes: dict | None = None,
                       extra_ignored: tuple[str, ...] = (), ckpt: SafetensorsCheckpoint | None = None
                       ) -> dict[str, jax.Array]:
    """{our name: jax.Array} for every entry of ``model_cls.weight_map(arch)``, ``arch``
    being the effective (tensor-parallel) architecture: each in ``dtype``, shaped as
    served and placed with the partitioning its Weight declares. ``transform(name,
    array) -> {name: array}`` (quantization) runs on each param as soon as it is
    placed, so only one param is ever held in ``dtype`` beside the transformed ones.
    ``param_dtypes``: params read in another dtype (pre-quantized int8 / fp8 weights);
    ``extra_ignored``: regexes of more tensors that may stay unread (their scales, read
    by the transform); ``ckpt``: the folder's reader when the caller made it (code views)."""
    ckpt = ckpt or SafetensorsCheckpoint(model_dir)
    check_checkpoint_names(ckpt, arch, model_cls, extra_ignored)
    param_dtypes = param_dtypes or {}
    weight_map = checkpoint_weight_map(model_cls, arch)
    total = sum(arch.num_hidden_layers if w.per_layer else 1 for w in weight_map.values())
    params = {}
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for name, w in weight_map.items():
            value = read_param(ckpt, w, arch, mesh, param_dtypes.get(name, dtype))
            if transform is None:
                params[name] = value
            else:
                params.update(jax.block_until_ready(transform(name, value)))
                del value
            bar.update(arch.num_hidden_layers if w.per_layer else 1)
    return params


def read_param(ckpt, weight: Weight, arch: ModelArchConfig, mesh: Mesh, dtype,
               layers: tuple[int, ...] | None = None) -> jax.Array:
    """One param read from ``ckpt`` (a SafetensorsCheckpoint, or anything with its
    ``read(name, index)``: models/param_update.py's ArrayCheckpoint) in ``dtype``, shaped
    as served for ``arch`` and placed with the partitioning ``weight`` declares; with
    ``layers``, only those layers of a stacked param ([len(layers), ...])."""
    if layers is not None:
        arch = dataclasses.replace(arch, num_hidden_layers=len(layers))
    value = jax.make_array_from_callback(weight.shape(arch), NamedSharding(mesh, P(*weight.partition)),
                                         _ShardReader(ckpt, weight, arch, dtype, layers), dtype=dtype)
    # Back-pressure: host-to-device copies may be asynchronous (accelerators); waiting
    # here keeps at most one param's host buffers alive at a time.
    return value.block_until_ready()
