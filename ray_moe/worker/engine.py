"""Engine: one rank's training state and step — model shard, optimizer, data, gradient sync.

Usable inside an EPWorker (a Ray actor, over a real transport) or directly in one process
(W = 1 with :class:`ray_moe.comm.local.LocalTransport`): the single-process reference that
expert-parallel training is compared with.

Loss scaling: each rank's loss is the mean over its tokens and the global loss is the mean of
the ranks' losses, so replicated gradients are all-reduced with an average, while an expert's
gradient (already summed over every rank's tokens by combine's backward) is divided by W.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_moe.clones import push_clone_weights, reduce_clone_grads
from ray_moe.comm.base import Transport
from ray_moe.config import Config
from ray_moe.data import Corpus
from ray_moe.device import synchronize
from ray_moe.model import MoETransformer, is_sharded
from ray_moe.placement import Placement
from ray_moe.topology import RankInfo


class Engine:
    def __init__(self, config: Config, rank_info: RankInfo, transport: Transport, device: torch.device):
        self.config, self.rank_info, self.transport, self.device = config, rank_info, transport, device
        self.rank, self.world_size = rank_info.rank, rank_info.world_size
        self.distributed = self.world_size > 1 and dist.is_initialized()
        self.corpus = Corpus.load(config.data, min_bytes=config.model.seq_len + 2)
        self.placement = Placement.native(
            config.moe.num_experts, self.world_size, config.balance.clone_slots
        )
        self.model = MoETransformer(config, transport, self.placement, device)
        self.sharded = [p for n, p in self.model.named_parameters() if is_sharded(n)]
        self.replicated = [p for n, p in self.model.named_parameters() if not is_sharded(n)]
        t = config.train
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95),
            foreach=False,
        )
        self.transport.timer.enabled = True  # communication time in the step breakdown
        self.step = 0  # steps taken (skipped ones included) == the data position
        self.opt_steps = 0  # optimizer updates applied (Adam's bias-correction counter)
        self.skipped = 0

    def describe(self) -> dict[str, Any]:
        n_rep = sum(p.numel() for p in self.replicated)
        n_exp = sum(p.numel() for p in self.sharded)
        return {
            "rank": self.rank, "device": str(self.device), "transport": self.transport.name,
            "replicated_params": n_rep, "expert_params_local": n_exp,
            "corpus_train_bytes": len(self.corpus.train), "corpus_files": self.corpus.files,
        }

    # ------------------------------------------------------------------ helpers
    def lr_at(self, step: int) -> float:
        t = self.config.train
        if t.warmup_steps and step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def batch(self, split: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, m = self.config.train, self.config.model
        x, y = self.corpus.batch(split, t.seed, step, t.batch_size, m.seq_len, self.rank, self.world_size)
        if int(x.max()) >= m.vocab_size:  # host tensors: no device sync
            raise ValueError(
                f"the corpus has byte values up to {int(x.max())} but model.vocab_size={m.vocab_size}; "
                "byte-level data needs vocab_size 256"
            )
        return x.to(self.device), y.to(self.device)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, aux = self.model(x)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        return ce, aux

    # ------------------------------------------------------------------ training
    def train_step(self, poison: bool = False) -> dict[str, Any]:
        """One optimizer step on this rank's slice of global batch ``self.step``.

        ``poison`` injects a NaN into this rank's activations (to test the non-finite policy).
        """
        self.model.train()
        self.transport.timer.pop()  # drop anything timed outside a training step
        t0 = time.perf_counter()
        x, y = self.batch("train", self.step)
        ce, aux = self.loss(x, y)
        if poison:
            ce = ce + float("nan")
        loss = ce + aux
        synchronize(self.device)
        t1 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        synchronize(self.device)
        t2 = time.perf_counter()
        grad_norm = self.sync_grads()
        finite = math.isfinite(grad_norm) and math.isfinite(self._all_max(ce.detach().float()))
        lr = self.lr_at(self.step)
        skipped = False
        if finite:
            clip = self.config.train.grad_clip
            if clip > 0 and grad_norm > clip:
                for p in self.model.parameters():
                    p.grad.mul_(clip / (grad_norm + 1e-6))
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.opt_steps += 1
            self.push_clones()
        else:
            skipped = True
            self.skipped += 1
            self.optimizer.zero_grad(set_to_none=False)
        self.step += 1
        synchronize(self.device)
        self.transport.check()  # device-side timeouts become an error naming the cause
        t3 = time.perf_counter()
        return {
            "rank": self.rank, "step": self.step, "loss": ce.item(), "aux_loss": float(aux.detach()),
            "tokens": x.numel(), "grad_norm": grad_norm, "lr": lr, "skipped": skipped,
            "nonfinite": not finite, "load": self.expert_load(),
            "time": {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2,
                     "step": t3 - t0, "comm": self.transport.timer.pop()},
        }

    def counters(self) -> dict[str, int]:
        return {"step": self.step, "opt_steps": self.opt_steps, "skipped": self.skipped}

    def _all_max(self, value: torch.Tensor) -> float:
        v = torch.where(torch.isfinite(value), value, torch.full_like(value, float("inf")))
        if self.distributed:
            v = v.to(self.device)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return float(v)

    def sync_grads(self) -> float:
        """Reduce gradients across ranks; return the global gradient norm (inf if non-finite)."""
        for layer in self.model.moe_layers():
            reduce_clone_grads(layer, layer.placement)
        if self.distributed:
            flat = torch.cat([p.grad.reshape(-1).float() for p in self.replicated])
            dist.all_reduce(flat)
            flat /= self.world_size
            offset = 0
            for p in self.replicated:
                n = p.numel()
                p.grad.copy_(flat[offset: offset + n].view_as(p.grad))
                offset += n
            for p in self.sharded:
                p.grad.div_(self.world_size)
        rep_sq = sum(p.grad.float().pow(2).sum() for p in self.replicated)
        exp_sq = sum(p.grad.float().pow(2).sum() for p in self.sharded)
        exp_sq = torch.as_tensor(exp_sq, device=self.device, dtype=torch.float32)
        if self.distributed:
            dist.all_reduce(exp_sq)
        total = float(rep_sq + exp_sq)
        return math.sqrt(total) if math.isfinite(total) else math.inf

    def push_clones(self) -> int:
        return sum(push_clone_weights(layer, layer.placement) for layer in self.model.moe_layers())

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> float:
        """Mean validation loss over ``batches`` fixed global batches (same on every rank)."""
        self.model.eval()
        n = batches or self.config.train.eval_batches
        total = torch.zeros((), dtype=torch.float64)
        for i in range(n):
            x, y = self.batch("val", i)
            ce, _ = self.loss(x, y)
            total += ce.double().cpu()
        if self.distributed:
            total = total.to(self.device)
            dist.all_reduce(total)
            total = total.cpu() / self.world_size
        # Evaluation must not count towards expert-load statistics.
        for layer in self.model.moe_layers():
            layer.pop_load()
        return float(total) / n

    def expert_load(self) -> dict[str, Any]:
        """Tokens routed from this rank to each logical expert, per MoE layer, since the last call."""
        per_layer, received = [], []
        for layer in self.model.moe_layers():
            tokens, pairs = layer.pop_load()
            per_layer.append(tokens.tolist())
            received.append(float(pairs))
        return {"rank": self.rank, "expert_tokens": per_layer, "received_pairs": received}

    # ------------------------------------------------------------------ placement
    def set_placements(self, placements: list[dict | None]) -> int:
        """New placements per MoE layer (None keeps a layer's); fills clone slots from the owners.

        Returns the bytes of clone weights this rank received.
        """
        layers = self.model.moe_layers()
        if len(placements) != len(layers):
            raise ValueError(f"got {len(placements)} placements for {len(layers)} MoE layers")
        for layer, p in zip(layers, placements):
            if p is not None:
                layer.set_placement(Placement.from_dict(p))
        return self.push_clones()

    def placement_versions(self) -> list[int]:
        return [layer.placement.version for layer in self.model.moe_layers()]

    # ------------------------------------------------------------------ checkpoints
    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's part of a checkpoint as flat named CPU tensors.

        Replicated parameters (and their optimizer state) come from rank 0 only; experts are keyed
        by logical expert id (``blocks.{i}.ffn.experts.{e}.w13``) so any world size can load them.
        """
        out: dict[str, torch.Tensor] = {}
        names = dict(self.model.named_parameters())
        for name, p in names.items():
            state = self.optimizer.state.get(p, {})
            if is_sharded(name):
                layer_prefix, kind = name.rsplit(".", 1)
                layer = self.model.get_submodule(layer_prefix)
                for slot, e in enumerate(layer.native_experts):
                    key = f"{layer_prefix}.experts.{e}.{kind}"
                    out[key] = p.detach()[slot].cpu().clone()
                    for s in ("exp_avg", "exp_avg_sq"):
                        if s in state:
                            out[f"optim.{key}.{s}"] = state[s][slot].cpu().clone()
            elif self.rank == 0:
                out[name] = p.detach().cpu().clone()
                for s in ("exp_avg", "exp_avg_sq"):
                    if s in state:
                        out[f"optim.{name}.{s}"] = state[s].cpu().clone()
        out[f"rng.rank{self.rank}.cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            out[f"rng.rank{self.rank}.cuda"] = torch.cuda.get_rng_state(self.device)
        return out

    def load_state(self, tensors: dict[str, torch.Tensor], step: int, opt_steps: int) -> None:
        """Load a full checkpoint (all ranks' tensors merged) into this rank's shard."""
        for layer in self.model.moe_layers():  # checkpoints hold native experts only
            layer.set_placement(self.placement)
        names = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, p in names.items():
                has_optim = opt_steps > 0
                state: dict[str, torch.Tensor] = {}
                if is_sharded(name):
                    layer_prefix, kind = name.rsplit(".", 1)
                    layer = self.model.get_submodule(layer_prefix)
                    for slot, e in enumerate(layer.native_experts):
                        key = f"{layer_prefix}.experts.{e}.{kind}"
                        p[slot].copy_(_need(tensors, key))
                        if has_optim:
                            for s in ("exp_avg", "exp_avg_sq"):
                                state.setdefault(s, torch.zeros_like(p))[slot].copy_(_need(tensors, f"optim.{key}.{s}"))
                else:
                    p.copy_(_need(tensors, name))
                    if has_optim:
                        for s in ("exp_avg", "exp_avg_sq"):
                            state[s] = _need(tensors, f"optim.{name}.{s}").to(p.device, p.dtype).clone()
                if has_optim:
                    state["step"] = torch.tensor(float(opt_steps))
                    self.optimizer.state[p] = state
        self.step, self.opt_steps = step, opt_steps
        # RNG streams are per rank: restored when this rank existed in the saved run.
        if f"rng.rank{self.rank}.cpu" in tensors:
            torch.set_rng_state(tensors[f"rng.rank{self.rank}.cpu"])
        if self.device.type == "cuda" and f"rng.rank{self.rank}.cuda" in tensors:
            torch.cuda.set_rng_state(tensors[f"rng.rank{self.rank}.cuda"], self.device)
        self.push_clones()


def _need(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise KeyError(f"checkpoint has no tensor {key!r}")
    return tensors[key]
