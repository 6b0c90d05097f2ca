"""The training loop shared by pretraining and fine-tuning: steps, with evaluation and checkpoints every N steps.

The loop knows nothing of masks, or of how a task evaluates or saves: it calls those functions when they are due,
and hands each checkpoint the metrics of the evaluation done at the same step (which keeps the best checkpoints).
It owns the budget (steps or wall-clock), the learning-rate progress, metric logging every `log_every` steps, and
the stop flag that SIGTERM raises (what preemptible machines receive before they are taken away).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from bertforge.errors import UserError
from bertforge.runtime import collector


class Preempted(Exception):
    """SIGTERM arrived; the loop saved a checkpoint and stopped."""


@dataclasses.dataclass(frozen=True)
class Every:
    """`fn` after steps offset + k * steps (k >= 1), and after the last step when that is not one of them (unless
    not `at_end`). An offset of (last step) % steps puts the last of them on the last step, with none after it.

    As `evaluate`, fn(step, state) returns metrics to log, or None; as `checkpoint`, fn(step, state, evaluation)
    gets the metrics of the evaluation done after the same step, or None.

    `last=False`: never after the budget's last step, unless a stop signal asks for it there (a checkpoint of the
    final state that the caller keeps in memory and writes out itself).
    """

    steps: int
    fn: Callable[..., Any]
    at_end: bool = True
    offset: int = 0
    last: bool = True

    def due(self, step: int) -> bool:
        return step >= self.steps and (step - self.offset) % self.steps == 0


@dataclasses.dataclass
class Budget:
    max_steps: int | None = None
    seconds: float | None = None

    def progress(self, step: int, elapsed: float) -> float:
        if self.seconds:
            return elapsed / self.seconds
        assert self.max_steps
        return step / self.max_steps

    def done(self, step: int, elapsed: float) -> bool:
        return (self.max_steps is not None and step >= self.max_steps) or (
            self.seconds is not None and elapsed >= self.seconds
        )


class StopFlag:
    """Set by SIGTERM (and SIGINT once); the loop asks `stop_after(step)` after every step.

    With several processes all must stop after the same step: saving is collective, and a process that ran one step
    more would wait forever for the others, as happens when a scheduler signals hosts a moment apart. There JAX's
    preemption service keeps SIGTERM: it tells every process and they agree on the step to stop after. A first
    SIGINT is handed to it as a SIGTERM.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}
        self._agreed = False

    def __enter__(self) -> StopFlag:
        self._agreed = jax.process_count() > 1 and bool(jax.config.jax_enable_preemption_service)
        for sig in (signal.SIGINT,) if self._agreed else (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum
        if self._agreed:
            signal.raise_signal(signal.SIGTERM)  # to the preemption service, which tells the other processes

    def stop_after(self, step: int) -> bool:
        """Whether to save and stop after `step`; with several processes, the same answer on each of them."""
        if not self._agreed:
            return self.signal is not None
        from jax.experimental import multihost_utils

        if not multihost_utils.reached_preemption_sync_point(step):
            return False
        self.signal = self.signal or signal.SIGTERM
        return True

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


OOM_HINT = (
    "out of device memory at the first step: lower train.global_batch, raise train.grad_accum, shard parameters "
    "with mesh.fsdp, recompute activations with model.remat=true, or shorten the sequences (preprocess --seq-len); "
    "`bertforge plan` estimates the memory of each choice"
)


def compile_train_step(
    train_step: Callable[..., Any], graphdef: Any, rest: Any, tx: Any, cfg: Any, state_shardings: Any
) -> Any:
    """train_step(graphdef, rest, state, batch, lr, key, tx, cfg) jitted over (state, batch, lr, key): the state is
    donated, so the update reuses its buffers, and comes back laid out as `state_shardings`."""
    return jax.jit(
        functools.partial(train_step, graphdef, rest, tx=tx, cfg=cfg),
        donate_argnums=(0,),
        out_shardings=(state_shardings, None),
    )


def run(
    state: Any,
    step_fn: Callable[[Any, Any, float], tuple[Any, dict[str, Any]]],
    *,
    next_batch: Callable[[float], Any],
    lr_at: Callable[[float], float],
    budget: Budget,
    log: Callable[[int, dict[str, float]], None],
    log_every: int,
    start_step: int = 0,
    evaluate: Every | None = None,
    checkpoint: Every | None = None,
    preemptible: bool = False,
    elapsed_before: float = 0.0,
    tokens_in: Callable[[Any], int] | None = None,
    flops_per_token: float = 0.0,
    peak_flops: float = float("nan"),
    clock: Callable[[float], float] | None = None,
) -> tuple[Any, int, float]:
    """Run steps until the budget is spent; returns (state, step, elapsed seconds). `next_batch(progress)` gives
    the batch of the step at `progress` (0..1) of the budget; `tokens_in(batch)`, when given, its token count, from
    which tokens/s and (with `flops_per_token`) MFU are logged.

        `preemptible`: on SIGTERM (or a first Ctrl-C) checkpoint after the current step and raise Preempted. The step
        the loop starts from is never checkpointed again: it was restored from a checkpoint (or is step 0).

        `clock`, given this process's elapsed seconds, returns the ones every process agrees on (process 0's). With it,
        a time budget sees the elapsed time of the last log boundary, refreshed at each: processes reading their own
        clocks could disagree on the step a deadline falls after (one would stop while the others wait for it in a
        collective for ever) and on the learning rate.
    """
    periodic = [e for e in (evaluate, checkpoint) if e is not None]
    roles = functools.partial(_run_due, log=log, evaluate=evaluate, checkpoint=checkpoint)
    step, timer = start_step, _Timer(elapsed_before, clock)
    pending: list[dict[str, Any]] = []
    with StopFlag() if preemptible else contextlib.nullcontext() as stop_flag, collector.settled() as settle:
        meter = ThroughputMeter(flops_per_token, peak_flops)  # after settling: no step's time
        while not budget.done(step, timer.for_budget()):
            progress = budget.progress(step, timer.for_budget())
            lr = lr_at(progress)
            batch = meter.take(functools.partial(next_batch, progress), tokens_in)
            state, metrics = _step(step_fn, state, batch, lr, first=step == start_step)
            step += 1
            pending.append(metrics)
            boundary = step % log_every == 0 or budget.done(step, timer.for_budget())
            stopping = stop_flag is not None and stop_flag.stop_after(step)
            if boundary or stopping or any(e.due(step) for e in periodic):
                _check_finite(pending, step)
            if boundary:
                pending = _log_window(log, step, pending, lr, meter, timer)
            due = functools.partial(_due, step=step, last=budget.done(step, timer.for_budget()))
            with meter.paused():  # the steps are done: _check_finite above waited for them
                # Kept for the run: the first step's programs, and what an evaluation or a checkpoint made.
                if roles(step, state, due, save_anyway=stopping) or step == start_step + 1:
                    settle()
            if stopping:
                raise Preempted(f"stopped by signal {stop_flag.signal} at step {step}")
        roles(step, state, functools.partial(_due_at_end, step=step, start_step=start_step, checkpoint=checkpoint))
    return state, step, timer.elapsed()


def _log_window(log: Callable[[int, dict[str, float]], None], step: int, pending: list[dict[str, Any]], lr: float,
                meter: ThroughputMeter, timer: _Timer) -> list[dict[str, Any]]:  # fmt: skip
    """Log the window of steps that ends at `step` (its metrics `pending`); start the next (nothing pending)."""
    log(step, {**_means(pending), "lr": lr, **meter.read(), "elapsed": timer.elapsed()})
    meter.start()
    timer.agree()
    return []


class ThroughputMeter:
    """Steps and tokens since the last log line, and the seconds they took: evaluations and checkpoints, run while
    the meter is `paused`, do not count."""

    def __init__(self, flops_per_token: float = 0.0, peak_flops: float = float("nan")) -> None:
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.start()

    def start(self) -> None:
        self.began, self.steps, self.tokens, self.paused_for, self.batching = time.perf_counter(), 0, 0, 0.0, 0.0

    def take(self, make: Callable[[], Any], tokens_in: Callable[[Any], int] | None) -> Any:
        """One step more: its batch, from `make()`, timed, and its tokens counted by `tokens_in` when given."""
        began = time.perf_counter()
        batch = make()
        self.batching += time.perf_counter() - began
        self.steps += 1
        self.tokens += tokens_in(batch) if tokens_in is not None else 0
        return batch

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.paused_for += time.perf_counter() - began

    def read(self) -> dict[str, float]:
        """step_time and batch_time (of it, the host's making of the batch: what the device may wait on while
        the steps before have finished), and with tokens counted tokens_per_s, and with FLOPs per token mfu."""
        seconds = time.perf_counter() - self.began - self.paused_for  # steps only, not evaluations
        record = {"step_time": seconds / self.steps, "batch_time": self.batching / self.steps}
        if self.tokens:
            record["tokens_per_s"] = self.tokens / seconds
        if self.tokens and self.flops_per_token:
            record["mfu"] = self.flops_per_token * self.tokens / seconds / self.peak_flops
        return record


class _Timer:
    """The run's elapsed seconds, and those a time budget sees: with a shared `clock`, what every process agreed on
    at the last log boundary."""

    def __init__(self, elapsed_before: float, clock: Callable[[float], float] | None) -> None:
        self.start = time.perf_counter() - elapsed_before
        self.agreed = elapsed_before
        self.clock = clock

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def for_budget(self) -> float:
        return self.agreed if self.clock is not None else self.elapsed()

    def agree(self) -> None:
        if self.clock is not None:
            self.agreed = self.clock(self.elapsed())


def _step(step_fn: Callable[..., Any], state: Any, batch: Any, lr: float, first: bool) -> tuple[Any, Any]:
    """One step; the first waits for its result, so that running out of memory there is told as such."""
    try:
        state, metrics = step_fn(state, batch, lr)
        if first:
            jax.block_until_ready(metrics)
    except Exception as e:  # XLA reports exhausted memory as a runtime error
        if first and "RESOURCE_EXHAUSTED" in str(e).upper():
            raise UserError(OOM_HINT) from None
        raise
    return state, metrics


def _means(pending: list[dict[str, Any]]) -> dict[str, float]:
    fetched = jax.device_get(pending)
    return {k: float(np.mean([m[k] for m in fetched])) for k in fetched[-1] if k != "finite"}


def _due(e: Every, step: int, last: bool) -> bool:
    """Whether `e` runs after `step`, `last` saying whether it is the budget's last."""
    return e.due(step) and (e.last or not last)


def _due_at_end(e: Every, step: int, start_step: int, checkpoint: Every | None) -> bool:
    return e.at_end and e.last and not e.due(step) and (e is not checkpoint or step != start_step)


def fires(evaluate: Every | None, checkpoint: Every | None, last: int) -> tuple[list[int], list[int]]:
    """The steps after which `evaluate` and `checkpoint` run in an unbroken run of `last` steps from step 0, by the
    rules `run` follows (no stop signal): (evaluation steps, checkpoint steps)."""
    out: tuple[list[int], list[int]] = ([], [])
    for step in range(1, last + 1):
        due = functools.partial(_due, step=step, last=step == last)
        for hook, steps in zip((evaluate, checkpoint), out, strict=True):
            if hook is not None and due(hook):
                steps.append(step)
    for hook, steps in zip((evaluate, checkpoint), out, strict=True):
        if hook is not None and _due_at_end(hook, last, 0, checkpoint):
            steps.append(last)
    return out


def _run_due(
    step: int,
    state: Any,
    due: Callable[[Every], bool],
    log: Callable[[int, dict[str, float]], None],
    evaluate: Every | None,
    checkpoint: Every | None,
    save_anyway: bool = False,
) -> bool:
    """Evaluate and then checkpoint with that evaluation's metrics, each when it is `due`; whether either ran."""
    evaluation, ran = None, False
    if evaluate is not None and due(evaluate):
        evaluation, ran = evaluate.fn(step, state), True
        if evaluation:
            log(step, evaluation)
    if checkpoint is not None and (save_anyway or due(checkpoint)):
        checkpoint.fn(step, state, evaluation)
        ran = True
    return ran


class NonFiniteLoss(UserError):
    def __init__(self, step: int):
        super().__init__(f"the loss became NaN or infinite at step {step}")
        self.step = step


def non_finite_error(e: NonFiniteLoss, before: str = "", after: str = "", first: tuple[str, ...] = ()) -> UserError:
    """What a driver stops with on `e`: the loop's words, with what the driver knows of its run `before` and `after`
    them, and the cure: a smaller step once the weights have moved; at the first step, which no update precedes,
    the starting weights or the precision, or the driver's `first` options."""
    if e.step > 1:
        return UserError(f"{before}{e}{after}; lower optim.lr or set optim.clip_norm")
    tries = " or ".join(("train.dtype=float32", *first))
    return UserError(f"{before}{e}{after}; no update came before it: check the model's weights, or try {tries}")


def _check_finite(pending: list[dict[str, Any]], step: int) -> None:
    flags = jax.device_get([m["finite"] for m in pending])
    for i, ok in enumerate(flags):
        if not bool(ok):
            bad = step - len(pending) + i + 1
            raise NonFiniteLoss(bad)
