"""A stand-in worker group for driver tests: steps count up, other calls answer fixed values, and
any method can be made to raise as a worker would (a WorkerFailure whose cause is the error)."""

from __future__ import annotations

from ray_moe.driver.errors import WorkerFailure


class DataError(ValueError):  # the worker's error class, as it arrives (matched by name)
    pass


class _TaskError(RuntimeError):
    """Stands for Ray's RayTaskError: the worker's exception is its ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _step_result(step: int, rank: int) -> dict:
    return {"step": step, "loss": 3.0 - 0.1 * step, "aux_loss": 0.0, "lr": 1e-3, "grad_norm": 1.0,
            "skipped": False, "nonfinite": False, "tokens": 64, "time": {"forward": 0.1},
            "load": {"expert_tokens": [[1.0, 2.0, 3.0, 4.0]], "received_pairs": [5 + rank]}}


class StandInGroup:
    """A worker group that trains (step counts up) and answers other calls from ``raises``: the
    method name -> the exception a worker raises for it. Its validation loss of batch i on rank r
    is ``val_loss(r, i)`` (2.5 unless set); ``eval_ranges`` lists the batch ranges asked for."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.ranks, self.closed = world_size, [], False
        self.step, self.calls, self.raises = 0, [], {}
        self.transport_name = "gloo"
        self.val_loss = lambda rank, i: 2.5
        self.eval_ranges: list[tuple[int, int]] = []

    def _answer(self, name: str):
        self.calls.append(name)
        if name in self.raises:
            failure = WorkerFailure(f"{name}: rank 0 raised {type(self.raises[name]).__name__}: "
                                    f"{self.raises[name]}", 0, "error")
            failure.__cause__ = _TaskError(self.raises[name])
            raise failure

    def call(self, method, *args, **_kwargs):
        self._answer(method.__name__)
        if method.__name__ == "generate":
            return [[7] * args[1]] * self.world_size
        return [object()] * self.world_size

    def call_each(self, method, args, **_kwargs):
        self._answer(method.__name__)
        if method.__name__ == "eval_sum":  # as Engine.eval_sum adds: in batch order, onto the running sum
            out = []
            for rank, (start, stop, running) in enumerate(args):
                for i in range(start, stop):
                    running += self.val_loss(rank, i)
                out.append(running)
            self.eval_ranges.append((args[0][0], args[0][1]))
            return out
        if method.__name__ == "eval_mean":  # as Engine.eval_mean: all-reduce, / world size, / batches
            return [sum(total for total, _ in args) / self.world_size / args[0][1]] * self.world_size
        self.step += 1
        return [_step_result(self.step, r) for r in range(self.world_size)]

    def health_check(self, timeout: float = 10.0) -> None:
        pass

    def close(self) -> None:
        self.closed = True
