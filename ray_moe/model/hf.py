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

``{moe}`` is ``block_sparse_moe`` for Mixtral (``mlp`` in transformers 5's memory), ``mlp`` else;
``{gate, up, down}`` are ``w1, w3, w2`` for Mixtral, ``gate_proj, up_proj, down_proj`` else. The
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
_ROUTED = re.compile(r"layers\.(\d+)\.mlp\.routed\.(router|score_bias|w13|w2)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class WeightsError(ValueError):
    """An HF model directory does not match the model (a missing, unexpected or misshapen tensor,
    a missing file); the message names the tensor or file."""


# ------------------------------------------------------------------------------------ names
def _moe_prefixes(spec: ArchSpec, layer: int) -> tuple[str, ...]:
    """Where a layer's MoE block lives in HF names, canonical (hub) first."""
    base = f"model.layers.{layer}."
    return (base + "block_sparse_moe", base + "mlp") if spec.family == "mixtral" else (base + "mlp",)


def _projections(spec: ArchSpec) -> tuple[str, str, str]:
    return ("w1", "w3", "w2") if spec.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def hf_names(spec: ArchSpec, name: str) -> tuple[str, ...]:
    """HF names (canonical first) of a replicated ray_moe parameter or persistent buffer."""
    m = _ROUTED.fullmatch(name)
    if m:
        layer, what = int(m.group(1)), m.group(2)
        if what in ("w13", "w2"):
            raise ValueError(f"{name} is expert-sharded: use expert_hf_names")
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


def fused_hf_names(spec: ArchSpec, layer: int) -> tuple[tuple[str, str], ...]:
    """(gate_up_proj, down_proj) names of transformers 5's fused expert tensors of a layer."""
    return tuple((f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj") for p in _moe_prefixes(spec, layer))


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


def expert_tensors(spec: ArchSpec, source: TensorSource, layer: int, expert: int,
                   what: str = "the checkpoint") -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [H, 2I], w2 [I, H]) of one logical expert from per-expert or fused HF tensors."""
    H, I = spec.hidden_size, spec.expert_hidden
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
        fused = [pair for pair in fused_hf_names(spec, layer) if pair[0] in have]
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
    source = SafetensorsDir(path)
    what = f"model.init_from={str(path)!r}"
    extra = int((hf_config or {}).get("num_nextn_predict_layers", 0) or 0) if spec.family == "glm4_moe" else 0
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
    m = re.fullmatch(r"layers\.(\d+)\.mlp\.routed\.experts\.(\d+)\.(w13|w2)", key)
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

    for key, load in tensors:
        for hf_name, t in to_hf(spec, key, load()):
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
