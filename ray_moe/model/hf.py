"""Hugging Face weights in and out: the name and layout map between a :class:`Decoder` and an HF
model directory (``config.json``, safetensors shards, ``model.safetensors.index.json``).

ray_moe's names are transformers' without the ``model.`` prefix, except the MoE blocks:

==========================================  =================================================
ray_moe (one rank)                          HF checkpoint
==========================================  =================================================
``layers.i.mlp.routed.router`` [H, E] fp32  ``model.layers.i.{moe}.gate.weight`` [E, H] (transposed)
``layers.i.mlp.routed.score_bias`` [E]      ``model.layers.i.mlp.gate.e_score_correction_bias``
``layers.i.mlp.routed.w13[slot]`` [H, 2I]   ``...experts.{e}.{gate}.weight`` [I, H]ᵀ | ``{up}.weight``ᵀ
``layers.i.mlp.routed.w2[slot]`` [I, H]     ``...experts.{e}.{down}.weight`` [H, I]ᵀ
==========================================  =================================================

``layers.i.mlp.routed.router_bias`` [E]     ``model.layers.i.mlp.router.bias`` (gpt-oss; its router weight is
                                            ``mlp.router.weight``)
``layers.i.mlp.routed.b13[slot]`` [2I]      gpt-oss: ``...experts.gate_up_proj_bias[e]`` (gate|up interleaved)
``layers.i.mlp.routed.b2[slot]`` [H]        gpt-oss: ``...experts.down_proj_bias[e]``
==========================================  =================================================

gpt-oss keeps its experts fused only: ``experts.gate_up_proj`` [E, H, 2I] with gate and up
interleaved (gate ``[..., ::2]``, up ``[..., 1::2]``), ``experts.down_proj`` [E, I, H]; ray_moe's
w13 splits them (gate first), and exports write them back fused and interleaved.

Published quantized weights are dequantized as they are read (:class:`DequantizedSource`):
DeepSeek-V3's FP8 (float8_e4m3fn ``X.weight`` with float32 ``X.weight_scale_inv`` per 128×128
block, ``quantization_config.weight_block_size``) and gpt-oss's MXFP4 (``X_blocks`` uint8
[..., rows, G, 16], two E2M1 values a byte, low nibble first, and ``X_scales`` uint8 E8M0
exponents [..., rows, G], one per 32 values; the dequantized [..., rows, 32G] is stored transposed).

``{moe}`` is ``block_sparse_moe`` for Mixtral and MiniMax-M2 (``mlp`` in transformers 5's memory),
``mlp`` else; ``{gate, up, down}`` are ``w1, w3, w2`` for those two, ``gate_proj, up_proj, down_proj``
else; MiniMax-M2's balancing bias is ``{moe}.e_score_correction_bias``. The
fused 3-D layout of transformers 5 (``experts.gate_up_proj`` [E, 2I, H], gate rows first;
``experts.down_proj`` [E, H, I]) is read too. Exports use the per-expert layout of the published
checkpoints, which every transformers version and vLLM read.

Loading (:func:`load_pretrained`) opens only the tensors a rank holds: the replicated ones and its
native experts (a slice of a fused tensor reads only that expert's rows).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from ray_moe.arch import ARCHITECTURES, ArchSpec
from ray_moe.model.state import persistent_buffers
from ray_moe.placement.placement import expert_shard

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "vocab.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
_ROUTED = re.compile(r"layers\.(\d+)\.mlp\.routed\.(router|router_bias|score_bias|w13|w2|b13|b2)")
MTP_FAMILIES = ("glm4_moe", "deepseek_v3")
MIXTRAL_NAMES = ("mixtral", "minimax_m2")  # block_sparse_moe, w1/w3/w2 in the published checkpoints  # checkpoints with num_nextn_predict_layers after the last layer
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class WeightsError(ValueError):
    """An HF model directory does not match the model (a missing, unexpected or misshapen tensor,
    a missing file); the message names the tensor or file."""


# ------------------------------------------------------------------------------------ names
def _moe_prefixes(spec: ArchSpec, layer: int) -> tuple[str, ...]:
    """Where a layer's MoE block lives in HF names, canonical (hub) first."""
    base = f"model.layers.{layer}."
    return (base + "block_sparse_moe", base + "mlp") if spec.family in MIXTRAL_NAMES else (base + "mlp",)


def _projections(spec: ArchSpec) -> tuple[str, str, str]:
    return ("w1", "w3", "w2") if spec.family in MIXTRAL_NAMES else ("gate_proj", "up_proj", "down_proj")


def hf_names(spec: ArchSpec, name: str) -> tuple[str, ...]:
    """HF names (canonical first) of a replicated ray_moe parameter or persistent buffer."""
    m = _ROUTED.fullmatch(name)
    if m:
        layer, what = int(m.group(1)), m.group(2)
        if what in ("w13", "w2", "b13", "b2"):
            raise ValueError(f"{name} is expert-sharded: use expert_hf_names")
        if spec.family == "gpt_oss":
            leaf = "router.weight" if what == "router" else "router.bias"
        elif spec.family == "minimax_m2":  # its balancing bias beside the gate, not in it
            leaf = "gate.weight" if what == "router" else "e_score_correction_bias"
        else:
            leaf = "gate.weight" if what == "router" else "gate.e_score_correction_bias"
        return tuple(f"{p}.{leaf}" for p in _moe_prefixes(spec, layer))
    if name == "lm_head.weight":
        return (name,)
    return ("model." + name,)


def expert_hf_names(spec: ArchSpec, layer: int, expert: int) -> tuple[tuple[str, str, str], ...]:
    """Per-expert (gate, up, down) HF names of one routed expert, canonical first."""
    gate, up, down = _projections(spec)
    return tuple(tuple(f"{p}.experts.{expert}.{w}.weight" for w in (gate, up, down))
                 for p in _moe_prefixes(spec, layer))


def fused_hf_names(spec: ArchSpec, layer: int) -> tuple[tuple[str, ...], ...]:
    """(gate_up_proj, down_proj[, gate_up_proj_bias, down_proj_bias]) names of transformers 5's
    fused expert tensors of a layer (the biases where the spec's experts have them)."""
    leaves = ("gate_up_proj", "down_proj") + (("gate_up_proj_bias", "down_proj_bias") if spec.expert_bias else ())
    return tuple(tuple(f"{p}.experts.{leaf}" for leaf in leaves) for p in _moe_prefixes(spec, layer))


# ------------------------------------------------------------------------------------ sources
class TensorSource:
    """Named tensors to read from, one at a time. ``read`` lists what was opened, in order (a
    fused expert tensor's slice as ``name[e]``)."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def names(self) -> set[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def _get(self, name: str, row: int | None) -> torch.Tensor:
        raise NotImplementedError

    def get(self, name: str, row: int | None = None) -> torch.Tensor:
        """The tensor ``name`` (or its row ``row`` along dim 0, reading only that row)."""
        self.read.append(name if row is None else f"{name}[{row}]")
        return self._get(name, row)


class SafetensorsDir(TensorSource):
    """An HF model directory: ``model.safetensors.index.json`` + shards, or one ``model.safetensors``.
    Files are memory-mapped and opened on first use; a tensor is read when asked for."""

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path).expanduser()
        index, single = self.path / INDEX, self.path / SINGLE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
                raise WeightsError(f"{str(index)!r} is not a safetensors index ({exc})") from None
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as f:
                weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise WeightsError(f"{str(self.path)!r} holds neither {INDEX} nor {SINGLE}")
        self.weight_map: dict[str, str] = dict(weight_map)
        self._files: dict[str, Any] = {}

    def _file(self, name: str) -> Any:
        from safetensors import safe_open

        fname = self.weight_map[name]
        if fname not in self._files:
            path = self.path / fname
            if not path.is_file():
                raise WeightsError(f"{str(path)!r} (listed for tensor {name!r}) does not exist")
            self._files[fname] = safe_open(str(path), framework="pt")
        return self._files[fname]

    def names(self) -> set[str]:
        return set(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def _get(self, name: str, row: int | None) -> torch.Tensor:
        f = self._file(name)
        return f.get_tensor(name) if row is None else f.get_slice(name)[row]


# ------------------------------------------------------------------------------------ reading
def _pick(source: TensorSource, names: tuple[str, ...]) -> str | None:
    have = source.names()
    return next((n for n in names if n in have), None)


def _need(source: TensorSource, names: tuple[str, ...], what: str) -> str:
    found = _pick(source, names)
    if found is None:
        raise WeightsError(f"{what} has no tensor {names[0]!r}")
    return found


def _checked(t: torch.Tensor, name: str, shape: tuple[int, ...], what: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise WeightsError(f"{what}: tensor {name!r} has shape {tuple(t.shape)}; the model's config "
                           f"expects {tuple(shape)}")
    return t


def replicated_tensor(spec: ArchSpec, source: TensorSource, name: str, shape: tuple[int, ...] | None = None,
                      what: str = "the checkpoint") -> torch.Tensor:
    """ray_moe tensor ``name`` (replicated parameter or buffer) from ``source``, checked against
    ``shape`` (ray_moe's) when given."""
    hf = _need(source, hf_names(spec, name), what)
    t = source.get(hf)
    router = name.endswith(".router")
    if shape is not None:
        _checked(t, hf, (shape[1], shape[0]) if router else tuple(shape), what)
    return t.t() if router else t


def _split_interleaved(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate and up interleaved (gpt-oss) → [..., 2I] gate | up."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] gate | up → gate and up interleaved (the inverse of :func:`_split_interleaved`)."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def expert_tensors(spec: ArchSpec, source: TensorSource, layer: int, expert: int,
                   what: str = "the checkpoint") -> tuple[torch.Tensor, ...]:
    """(w13 [H, 2I], w2 [I, H]) of one logical expert from per-expert or fused HF tensors, and
    (b13 [2I], b2 [H]) after them where the spec's experts have biases (gpt-oss, fused only)."""
    H, I = spec.hidden_size, spec.expert_hidden
    if spec.family == "gpt_oss":
        names = fused_hf_names(spec, layer)[0]
        E = spec.num_experts
        shapes = ((E, H, 2 * I), (E, I, H), (E, 2 * I), (E, H))
        for name, shape in zip(names, shapes):
            _checked(torch.empty(source.shape(_need(source, (name,), what)), device="meta"), name, shape, what)
        gate_up, down, gate_up_bias, down_bias = (source.get(n, expert) for n in names)
        return _split_interleaved(gate_up), down, _split_interleaved(gate_up_bias), down_bias
    for gate, up, down in expert_hf_names(spec, layer, expert):
        if _pick(source, (gate,)):
            g = _checked(source.get(gate), gate, (I, H), what)
            u = _checked(source.get(_need(source, (up,), what)), up, (I, H), what)
            d = _checked(source.get(_need(source, (down,), what)), down, (H, I), what)
            return torch.cat([g.t(), u.t()], dim=1), d.t()
    for gate_up, down in fused_hf_names(spec, layer):
        if _pick(source, (gate_up,)):
            E = spec.num_experts
            _checked(torch.empty(source.shape(gate_up), device="meta"), gate_up, (E, 2 * I, H), what)
            _checked(torch.empty(source.shape(down), device="meta"), down, (E, H, I), what)
            return source.get(gate_up, expert).t(), source.get(down, expert).t()
    raise WeightsError(f"{what} has no tensor {expert_hf_names(spec, layer, expert)[0][0]!r}")


def expected_hf_names(spec: ArchSpec, model: torch.nn.Module, source: TensorSource) -> set[str]:
    """Every HF name the whole model (all experts) takes from ``source``, in the layouts it has."""
    out: set[str] = set()
    have = source.names()
    for name, _ in _replicated(model):
        out.add(_pick(source, hf_names(spec, name)) or hf_names(spec, name)[0])
    for layer in _moe_layer_indices(model):
        fused = [pair for pair in fused_hf_names(spec, layer) if pair[0] in have or spec.family == "gpt_oss"]
        if fused:
            out.update(fused[0])
            continue
        for e in range(spec.num_experts):
            names = expert_hf_names(spec, layer, e)
            out.update(next((n for n in names if n[0] in have), names[0]))
    return out


def _ignorable(spec: ArchSpec, name: str, extra_layers: int) -> bool:
    """Tensors an HF directory may hold that the model does not use: rotary caches, and GLM's
    multi-token-prediction layers (``num_nextn_predict_layers``, numbered after the last layer)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    m = _LAYER.match(name)
    return bool(m) and spec.num_layers <= int(m.group(1)) < spec.num_layers + extra_layers


def _replicated(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every replicated parameter and persistent buffer."""
    params = [(n, p) for n, p in model.named_parameters() if expert_shard(p) is None]
    return params + persistent_buffers(model)


def _moe_layer_indices(model: torch.nn.Module) -> list[int]:
    return [layer.layer_idx for layer in model.moe_layers()]


@torch.no_grad()
def load_pretrained(model: torch.nn.Module, path: str | Path, hf_config: Mapping[str, Any] | None = None) -> list[str]:
    """Fill ``model`` (a :class:`~ray_moe.model.decoder.Decoder` shard) from the HF directory
    ``path``: the replicated tensors and this rank's native experts (clone slots are filled
    from their owners by the caller). Returns the HF tensor names opened, in order.

    Raises :class:`WeightsError` naming a missing tensor, a tensor of the wrong shape, or a
    tensor that is not part of this model.
    """
    spec: ArchSpec = model.spec
    source = DequantizedSource(SafetensorsDir(path), hf_config)
    what = f"model.init_from={str(path)!r}"
    extra = int((hf_config or {}).get("num_nextn_predict_layers", 0) or 0) if spec.family in MTP_FAMILIES else 0
    unexpected = sorted(n for n in source.names() - expected_hf_names(spec, model, source)
                        if not _ignorable(spec, n, extra))
    if unexpected:
        raise WeightsError(f"{what}: tensor {unexpected[0]!r} is not part of a {spec.family} model of this "
                           f"config ({len(unexpected)} such tensors; num_hidden_layers={spec.num_layers})")
    for name, t in _replicated(model):
        t.copy_(replicated_tensor(spec, source, name, tuple(t.shape), what))
    for layer in model.moe_layers():
        for slot, e in enumerate(layer.native_experts):
            layer.load_expert(slot, *expert_tensors(spec, source, layer.layer_idx, e, what))
    return list(source.read)


# ------------------------------------------------------------------------------------ writing
def to_hf(spec: ArchSpec, key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one ray_moe checkpoint tensor (:mod:`ray_moe.checkpoint`'s key
    schema: ``...routed.experts.{e}.w13``, ``buffer.{name}``, replicated names); nothing for
    optimizer state and RNG."""
    if key.startswith(("optim.", "rng.")):
        return
    if key.startswith("buffer."):
        key = key[len("buffer."):]
    m = re.fullmatch(r"layers\.(\d+)\.mlp\.routed\.experts\.(\d+)\.(w13|w2|b13|b2)", key)
    if m and spec.family == "gpt_oss":
        raise ValueError(f"{key}: gpt-oss experts are written fused (write_hf_dir stacks them)")
    if m:
        layer, e, kind = int(m.group(1)), int(m.group(2)), m.group(3)
        gate, up, down = expert_hf_names(spec, layer, e)[0]
        if kind == "w13":
            I = tensor.shape[1] // 2
            yield gate, tensor[:, :I].t().contiguous()
            yield up, tensor[:, I:].t().contiguous()
        else:
            yield down, tensor.t().contiguous()
        return
    hf = hf_names(spec, key)[0]
    yield hf, (tensor.t().contiguous() if key.endswith(".router") else tensor)


def hf_config_for_export(spec: ArchSpec, hf_config: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """The config.json to write: the run's HF config with its architecture and dtype named."""
    out = dict(hf_config)
    out.pop("quantization_config", None)  # the weights are written dequantized
    out["architectures"] = [ARCHITECTURES[spec.family]]
    out["model_type"] = spec.family
    out["dtype"] = out["torch_dtype"] = dtype  # transformers 5 reads dtype; 4.x and older tools torch_dtype
    return out


def write_hf_dir(out: str | Path, spec: ArchSpec, hf_config: Mapping[str, Any],
                 tensors: Iterable[tuple[str, Callable[[], torch.Tensor]]], dtype: torch.dtype,
                 max_shard_bytes: int = 5 << 30, tokenizer_dir: str | Path | None = None) -> dict[str, Any]:
    """Write an HF model directory: config.json, safetensors shards (at most ``max_shard_bytes``
    each, one tensor at a time in memory besides the shard being filled) with an index, and the
    tokenizer files of ``tokenizer_dir`` when given.

    tensors: (ray_moe checkpoint key, loader) pairs; each loader returns the tensor when called.
    Returns {"files": [...], "tensors": count, "bytes": total}.
    """
    from safetensors.torch import save_file

    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    dtype_name = str(dtype).removeprefix("torch.")
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total, temp_files, weight_map = 0, 0, [], {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f".shard-{len(temp_files):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            temp_files.append((name, list(shard)))
            shard, shard_bytes = {}, 0

    stacker = _FusedExperts(spec)
    for key, load in tensors:
        pairs = stacker.add(key, load) if stacker.takes(key) else to_hf(spec, key, load())
        for hf_name, t in pairs:
            if not key.startswith("buffer."):
                t = t.to(dtype)  # buffers (the balancing bias) stay float32, as transformers keeps them
            size = t.numel() * t.element_size()
            if shard and shard_bytes + size > max_shard_bytes:
                flush()
            shard[hf_name] = t.contiguous()
            shard_bytes += size
            total += size
    flush()
    n = len(temp_files)
    files = []
    for i, (tmp, names) in enumerate(temp_files):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(out / tmp, out / final)
        files.append(final)
        weight_map.update({k: final for k in names})
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config_for_export(spec, hf_config, dtype_name), indent=2))
    copied = []
    if tokenizer_dir:
        tok = Path(tokenizer_dir).expanduser()
        for fname in TOKENIZER_FILES:
            if (tok / fname).is_file():
                shutil.copyfile(tok / fname, out / fname)
                copied.append(fname)
        if not copied:
            raise WeightsError(f"data.tokenizer={str(tok)!r} holds none of {', '.join(TOKENIZER_FILES)}")
    return {"files": files + [INDEX, "config.json"] + copied, "tensors": len(weight_map), "bytes": total}


class _FusedExperts:
    """gpt-oss's fused expert tensors for an export: collects a layer's per-expert checkpoint
    tensors (``...experts.{e}.w13`` etc.) and yields the fused, interleaved HF tensor of a kind once
    all its experts are in (a checkpoint lists a layer's experts together, so about one layer's
    experts of one kind are held at a time)."""

    _KEY = re.compile(r"layers\.(\d+)\.mlp\.routed\.experts\.(\d+)\.(w13|w2|b13|b2)")
    _LEAF = {"w13": "gate_up_proj", "w2": "down_proj", "b13": "gate_up_proj_bias", "b2": "down_proj_bias"}

    def __init__(self, spec: ArchSpec):
        self.spec = spec
        self.pending: dict[tuple[int, str], dict[int, torch.Tensor]] = {}

    def takes(self, key: str) -> bool:
        return self.spec.family == "gpt_oss" and self._KEY.fullmatch(key) is not None

    def add(self, key: str, load: Callable[[], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        layer, e, kind = self._KEY.fullmatch(key).groups()
        got = self.pending.setdefault((int(layer), kind), {})
        got[int(e)] = load()
        if len(got) < self.spec.num_experts:
            return
        del self.pending[(int(layer), kind)]
        t = torch.stack([got[i] for i in range(self.spec.num_experts)])
        if kind in ("w13", "b13"):
            t = _interleave(t)
        yield f"model.layers.{layer}.mlp.experts.{self._LEAF[kind]}", t


# ------------------------------------------------------------------------------------ quantized
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of FP4 E2M1's codes 0..7 (bit 3: sign)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [out, in] of a float8 ``weight`` [out, in] and its float32 ``scale_inv``
    [ceil(out / bo), ceil(in / bi)] (one factor per ``block`` = (bo, bi) tile, multiplied)."""
    bo, bi = block
    out_dim, in_dim = weight.shape
    s = scale_inv.float().repeat_interleave(bo, 0)[:out_dim].repeat_interleave(bi, 1)[:, :in_dim]
    return weight.float() * s


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., 32G, rows] of MXFP4 ``blocks`` uint8 [..., rows, G, 16] (two E2M1 codes per
    byte, the low nibble first) and ``scales`` uint8 [..., rows, G] (E8M0: 2^(s - 127) for each
    32 values), transposed as gpt-oss stores its parameters ([in, out] per expert)."""
    lut = torch.tensor(E2M1, dtype=torch.float32)
    lut = torch.cat([lut, -lut])
    b = blocks.to(torch.int64)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)  # [..., rows, G, 32]
    values = lut[codes] * torch.exp2(scales.to(torch.float32) - 127.0).unsqueeze(-1)
    return values.flatten(-2).transpose(-1, -2)


class DequantizedSource(TensorSource):
    """``inner`` with its quantized tensors read dequantized (float32): an FP8 ``X.weight`` with its
    ``X.weight_scale_inv`` is read as ``X.weight``; MXFP4 ``X_blocks`` / ``X_scales`` as ``X`` (a
    row of X reads that row of both). The scale tensors are not listed; ``read`` is inner's."""

    def __init__(self, inner: TensorSource, hf_config: Mapping[str, Any] | None = None):
        super().__init__()
        self.inner = inner
        self.read = inner.read
        q = (hf_config or {}).get("quantization_config") or {}
        self.block = tuple(q.get("weight_block_size") or (128, 128))
        have = inner.names()
        self.fp8 = {n[: -len("_scale_inv")] for n in have if n.endswith(".weight_scale_inv")}
        self.mxfp4 = {n[: -len("_blocks")] for n in have if n.endswith("_blocks") and n[:-7] + "_scales" in have}
        hidden = {n + "_scale_inv" for n in self.fp8} | {n + "_blocks" for n in self.mxfp4} | {
            n + "_scales" for n in self.mxfp4}
        self._names = (have - hidden) | self.mxfp4

    def names(self) -> set[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.mxfp4:
            *prefix, rows, G, _ = self.inner.shape(name + "_blocks")
            return (*prefix, 32 * G, rows)
        return self.inner.shape(name)

    def get(self, name: str, row: int | None = None) -> torch.Tensor:
        if name in self.mxfp4:
            return dequantize_mxfp4(self.inner.get(name + "_blocks", row), self.inner.get(name + "_scales", row))
        t = self.inner.get(name, row)
        if name in self.fp8:
            if row is not None:
                raise WeightsError(f"{name}: a row of an FP8 block-scaled tensor is not read alone")
            return dequantize_fp8_blocks(t, self.inner.get(name + "_scale_inv"), self.block)
        return t
