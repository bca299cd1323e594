"""The hidden-state shard encoding (docs/FORMAT.md#hidden-state-shards).

A shard is one safetensors file holding several samples. We write the file
ourselves so that each sample's tensors are contiguous, in the order
`hidden_states`, [`scales`], `token_ids`, `loss_mask`; the manifest records each
sample's byte range, so a reader fetches one sample with one range read and
never downloads the whole shard. The file is ordinary safetensors: safe_open
reads it, and nothing in it is pickle.

Per sample i (T tokens, L stored layers = aux ids + the final layer, H hidden):
  "{i}.hidden_states"  BF16 [T, L, H]   (or F8_E4M3 for fp8 storage)
  "{i}.scales"         F32  [T, L]      fp8 only: value = fp8 * scale
  "{i}.token_ids"      I64  [T]
  "{i}.loss_mask"      U8   [T]
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from eagle_jobs.records import SampleEntry

FORMAT = "eagle-jobs/hidden-states/v1"
FP8_MAX = 448.0  # float8_e4m3fn

_DTYPES = {
    torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32",
    torch.int64: "I64", torch.uint8: "U8",
}
_TORCH = {v: k for k, v in _DTYPES.items()}


def bytes_per_token(num_layers: int, hidden: int, storage: str) -> int:
    if storage == "fp8":
        return num_layers * hidden + num_layers * 4 + 8 + 1
    return num_layers * hidden * 2 + 8 + 1


def resolve_storage(setting: str, tokens: int, num_layers: int, hidden: int, fp8_above_bytes: int) -> str:
    """extract.storage_dtype: bfloat16 or fp8 as set; auto, fp8 once the corpus's states would take more
    than extract.fp8_above_bytes in bf16. Extraction and a streaming trainer resolve it from the same
    committed rows (every row's tokens), so they agree on the layout without talking to each other."""
    return storage_for(setting, tokens * bytes_per_token(num_layers, hidden, "bfloat16"), fp8_above_bytes)


def storage_for(setting: str, bf16_bytes: int, fp8_above_bytes: int) -> str:
    """The one auto-dtype rule: the setting as it is, or for auto fp8 once the states would take more than
    fp8_above_bytes in bf16 (used by extraction, a streaming trainer and plan --scale's corpora)."""
    if setting != "auto":
        return setting
    return "fp8" if bf16_bytes > fp8_above_bytes else "bfloat16"


@dataclass
class Sample:
    row_id: str
    hidden_states: torch.Tensor  # [T, L, H], any float dtype
    token_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T]


def quantize_fp8(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one scale per token and layer (hs-connectors uses one per token)."""
    h = h.float()
    amax = h.abs().amax(dim=-1).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (h / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float32)


def _tensors(s: Sample, storage: str) -> list[tuple[str, torch.Tensor]]:
    if storage == "fp8":
        q, scale = quantize_fp8(s.hidden_states)
        hs = [("hidden_states", q), ("scales", scale)]
    else:
        hs = [("hidden_states", s.hidden_states.to(torch.bfloat16))]
    return hs + [("token_ids", s.token_ids.to(torch.int64)), ("loss_mask", s.loss_mask.to(torch.uint8))]


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def encode_shard(samples: list[Sample], layer_ids: list[int], storage: str) -> tuple[bytes, list[dict]]:
    """Returns the shard bytes and, per sample, its index entry for the manifest."""
    header: dict = {}
    chunks: list[bytes] = []
    index: list[dict] = []
    pos = 0
    for i, s in enumerate(samples):
        start = pos
        tensors = {}
        for name, t in _tensors(s, storage):
            raw = _raw(t)
            header[f"{i}.{name}"] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                                     "data_offsets": [pos, pos + len(raw)]}
            tensors[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "offset": pos - start}
            chunks.append(raw)
            pos += len(raw)
        index.append({"row_id": s.row_id, "num_tokens": int(s.token_ids.numel()), "start": start,
                      "length": pos - start, "tensors": tensors})
    header["__metadata__"] = {"format": FORMAT, "storage": storage, "layer_ids": json.dumps(layer_ids),
                              "row_ids": json.dumps([s.row_id for s in samples])}
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)  # data starts 8-byte aligned, as safetensors recommends
    prefix = struct.pack("<Q", len(hjson)) + hjson
    for e in index:  # absolute offsets in the object
        e["start"] += len(prefix)
    return prefix + b"".join(chunks), index


def decode_sample(buf: bytes | bytearray, entry: SampleEntry,
                  dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """One sample from its byte range: hidden_states [T, L, H] in `dtype`, token_ids, loss_mask.

    Decoded in place: the tensors share the buffer's memory, so a bytearray costs no copy of a
    Kimi-size sample's 470 MB. bytes, which are read-only, are copied into one bytearray first."""
    if not isinstance(buf, bytearray):
        buf = bytearray(buf)
    out: dict[str, torch.Tensor] = {}
    for name, t in entry["tensors"].items():
        tdtype = _TORCH[t["dtype"]]
        n = 1
        for d in t["shape"]:
            n *= d
        if not n:
            out[name] = torch.empty(t["shape"], dtype=tdtype)
            continue
        flat = torch.frombuffer(buf, dtype=tdtype, count=n, offset=t["offset"])
        out[name] = flat.reshape(t["shape"])
    hs = out["hidden_states"]
    if "scales" in out:
        hs = hs.float() * out.pop("scales").unsqueeze(-1)
    out["hidden_states"] = hs.to(dtype)
    out["loss_mask"] = out["loss_mask"].to(torch.bool)
    return out


def sample_problem(hs: torch.Tensor, token_ids: list[int] | torch.Tensor, expected_ids: list[int],
                   num_layers: int, hidden: int) -> str | None:
    """Why a record must not be trained on, or None: shape, token ids, non-finite values."""
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
    if ids != list(expected_ids):
        return "token ids differ from the capture row"
    if tuple(hs.shape) != (len(expected_ids), num_layers, hidden):
        return f"shape {tuple(hs.shape)} != ({len(expected_ids)}, {num_layers}, {hidden}) (truncated?)"
    if not bool(torch.isfinite(hs).all()):
        return "non-finite values (NaN/inf)"
    return None
