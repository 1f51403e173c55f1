"""Per-shape choice of the expert implementation, measured on first use (``moe.expert_impl: auto``).

Candidates (each correct; which is fastest depends on the shape and the GPU):

- ``triton``: the fused Triton kernels for every GEMM (gather fused into the loads, SwiGLU and
  the routing weight in the epilogues, no permuted copies);
- ``triton+mm_wgrad``: the same forward and activation gradients, with the two weight-gradient
  GEMMs through ``torch._grouped_mm`` on gathered rows (cuBLAS/CUTLASS speed for dW13/dW2,
  at the cost of materialising the gathered rows);
- ``triton+quack_wgrad`` (where quack, the GEMM library under SonicMoE, is installed): the
  weight gradients through quack's varlen-K CUTLASS GEMM, which gathers the rows itself (see
  :mod:`ray_moe.kernels.quack_wgrad`);
- ``grouped_mm``: the torch path (argsort, ``x[rows]``, ``_grouped_mm``, ``index_add``).

:class:`ExpertImplChooser` times every candidate once per shape key (rows rounded up to a power
of two, top-k, slots, H, I, dtype, device, whether gradients are needed) on the call's own
inputs, forward and, for training, backward, in interleaved rounds, and keeps the fastest median,
like Triton's autotuner: host synchronisations on a shape's first call only, never inside a
CUDA-graph capture (there the default, ``triton``, is used and nothing is recorded). A candidate
that fails (unsupported shape or dtype, out of memory) is skipped with its reason kept in
:attr:`ExpertImplChooser.timings`.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertChoice:
    """What ``expert_ffn`` runs: ``impl`` (triton | grouped_mm | loop) and, for triton, who
    computes the weight gradients (``wgrad``: triton | grouped_mm | quack)."""

    impl: str
    wgrad: str = "triton"

    @property
    def name(self) -> str:
        if self.impl != "triton" or self.wgrad == "triton":
            return self.impl
        return f"triton+{'mm' if self.wgrad == 'grouped_mm' else self.wgrad}_wgrad"


CANDIDATES = (ExpertChoice("triton"), ExpertChoice("triton", "grouped_mm"), ExpertChoice("grouped_mm"))
QUACK_WGRAD = ExpertChoice("triton", "quack")
DEFAULT = CANDIDATES[0]


def default_candidates() -> tuple[ExpertChoice, ...]:
    """:data:`CANDIDATES` plus ``triton+quack_wgrad`` where quack is installed (checked without
    importing it): what ``ExpertImplChooser()`` measures."""
    from ray_moe.kernels.quack_wgrad import quack_available

    return CANDIDATES + ((QUACK_WGRAD,) if quack_available() else ())


Timer = Callable[[Callable[[], object], str], float]


def bench_timer(warmup_ms: int = 10, rep_ms: int = 40) -> Timer:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (synchronises the device)."""
    def time_ms(fn: Callable[[], object], name: str) -> float:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))

    return time_ms


class ExpertImplChooser:
    """Measures the candidates once per shape and remembers the fastest (one per model; every
    MoE layer of the same shape shares the measurement).

    Attributes:
        choices: shape key → the chosen :class:`ExpertChoice`.
        timings: shape key → {candidate name: median milliseconds, or the error that ruled it out}.
    """

    def __init__(self, candidates: tuple[ExpertChoice, ...] | None = None, timer: Timer | None = None,
                 rounds: int = 3) -> None:
        """candidates: what to measure (default :func:`default_candidates`); timer(fn, candidate
        name) → milliseconds per call of fn (default :func:`bench_timer`); rounds: how many times
        each candidate is timed, interleaved with the others (the median is kept)."""
        if rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {rounds}")
        self.candidates = default_candidates() if candidates is None else candidates
        self.timer, self.rounds = timer or bench_timer(), rounds
        self.choices: dict[tuple, ExpertChoice] = {}
        self.timings: dict[tuple, dict[str, float | str]] = {}

    @staticmethod
    def key(x: torch.Tensor, slot: torch.Tensor, w13: torch.Tensor, needs_grad: bool, act=None,
            biases: bool = False) -> tuple:
        """Rows are bucketed to the next power of two: transports with host-synced splits (NCCL)
        receive a different R every step, and one measurement must serve them all. The activation
        and whether the experts have biases are part of the key (other epilogues, other timings)."""
        rows = 1 << max(int(x.shape[0]) - 1, 0).bit_length()
        key = (rows, x.shape[1], slot.shape[1], tuple(w13.shape), x.dtype, str(x.device), needs_grad)
        return key if act is None and not biases else key + (act, biases)

    def choose(self, x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor, needs_grad: bool, act=None, b13: torch.Tensor | None = None,
               b2: torch.Tensor | None = None) -> ExpertChoice:
        """The fastest candidate for this shape (measured now if the shape is new).

        Args: the arguments of :func:`ray_moe.model.experts.expert_ffn`: x [R, H], slot int [R, K],
        weight float32 [R, K], w13 [S, H, 2I], w2 [S, I, H], act (None: SwiGLU), b13 [S, 2I] and
        b2 [S, H] (or None); needs_grad: time backward too.
        """
        key = self.key(x, slot, w13, needs_grad, act, b13 is not None)
        hit = self.choices.get(key)
        if hit is not None:
            return hit
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return DEFAULT
        # The candidates' own forward+backward must not use the saved-tensor hooks of an enclosing
        # activation-checkpointed block: its nested backward would replay the block.
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            timings = self._measure(x, slot, weight, w13, w2, needs_grad, act, b13, b2)
        ok = {n: t for n, t in timings.items() if isinstance(t, float)}
        best = min(ok, key=ok.get) if ok else DEFAULT.name
        choice = next(c for c in self.candidates if c.name == best) if ok else DEFAULT
        self.choices[key], self.timings[key] = choice, timings
        log.info("expert impl for R=%d K=%d S=%d H=%d I=%d %s (grad=%s): %s; ms %s", x.shape[0], slot.shape[1],
                 w13.shape[0], x.shape[1], w2.shape[1], str(x.dtype).replace("torch.", ""), needs_grad,
                 choice.name, {n: (round(t, 3) if isinstance(t, float) else t) for n, t in timings.items()})
        return choice

    def _measure(self, x, slot, weight, w13, w2, needs_grad, act=None, b13=None, b2=None) -> dict[str, float | str]:
        from ray_moe.model.experts import SWIGLU, expert_ffn

        # views, not copies: cloning w13/w2 would double the expert weights' memory for a moment
        params = (x, weight, w13, w2) + (() if b13 is None else (b13, b2))
        leaves = [t.detach().requires_grad_(needs_grad) for t in params]
        biases = {} if b13 is None else dict(b13=leaves[4], b2=leaves[5])
        slot = slot.detach()
        # a private generator: measuring must not advance the training RNG (exact resume)
        gen = torch.Generator(device=x.device).manual_seed(0)
        grad_out = torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype) if needs_grad else None

        def step(cand: ExpertChoice) -> None:
            with torch.enable_grad() if needs_grad else torch.no_grad():
                y = expert_ffn(leaves[0], slot, leaves[1], leaves[2], leaves[3], impl=cand.impl, wgrad=cand.wgrad,
                               act=act or SWIGLU, **biases)
                if needs_grad:
                    torch.autograd.grad(y, leaves, grad_out)

        # Rounds interleave the candidates so that a drift of the clock (a GPU at its power cap
        # slows down over a second of load) does not favour whichever ran first; the median of a
        # candidate's rounds is kept. A candidate that fails once is out (with its reason).
        samples: dict[str, list[float]] = {c.name: [] for c in self.candidates}
        failed: dict[str, str] = {}
        for _ in range(self.rounds):
            for cand in self.candidates:
                if cand.name in failed:
                    continue
                try:
                    samples[cand.name].append(float(self.timer(lambda cand=cand: step(cand), cand.name)))
                except Exception as exc:  # any failure rules the candidate out (OOM, Triton compile errors, ...)
                    failed[cand.name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
                    log.warning("expert impl candidate %s failed and is skipped: %s", cand.name, failed[cand.name])
                    if x.is_cuda:
                        torch.cuda.empty_cache()
        return {c.name: failed.get(c.name) or statistics.median(samples[c.name]) for c in self.candidates}


def _keep(t: torch.Tensor) -> torch.Tensor:
    """An identity saved-tensor hook: save and restore tensors as autograd would without hooks."""
    return t

