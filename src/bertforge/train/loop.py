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
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from bertforge.errors import UserError


class Preempted(Exception):
    """SIGTERM arrived; the loop saved a checkpoint and stopped."""


@dataclasses.dataclass(frozen=True)
class Every:
    """`fn` after steps offset + k * steps (k >= 1), and after the last step when that is not one of them (unless
    not `at_end`). An offset of (last step) % steps puts the last of them on the last step, with none after it.

    As `evaluate`, fn(step, state) returns metrics to log, or None; as `checkpoint`, fn(step, state, evaluation)
    gets the metrics of the evaluation done after the same step, or None.
    """

    steps: int
    fn: Callable[..., Any]
    at_end: bool = True
    offset: int = 0

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
    step = start_step
    start = time.perf_counter() - elapsed_before
    agreed = elapsed_before

    def budget_elapsed() -> float:
        return agreed if clock is not None else time.perf_counter() - start

    pending: list[dict[str, Any]] = []
    window_start, window_steps, window_tokens, window_paused = time.perf_counter(), 0, 0, 0.0
    last_lr = 0.0
    with StopFlag() if preemptible else contextlib.nullcontext() as stop_flag:
        while not budget.done(step, budget_elapsed()):
            progress = budget.progress(step, budget_elapsed())
            lr = lr_at(progress)
            batch = next_batch(progress)
            window_tokens += tokens_in(batch) if tokens_in is not None else 0
            try:
                state, metrics = step_fn(state, batch, lr)
                if step == start_step:
                    jax.block_until_ready(metrics)
            except Exception as e:  # XLA reports exhausted memory as a runtime error
                if step == start_step and "RESOURCE_EXHAUSTED" in str(e).upper():
                    raise UserError(OOM_HINT) from None
                raise
            step += 1
            window_steps += 1
            last_lr = lr
            pending.append(metrics)
            boundary = step % log_every == 0 or budget.done(step, budget_elapsed())
            stopping = stop_flag is not None and stop_flag.stop_after(step)
            if boundary or stopping or any(e.due(step) for e in periodic):
                _check_finite(pending, step)
            if boundary:
                fetched = jax.device_get(pending)
                seconds = time.perf_counter() - window_start - window_paused  # steps only, not evaluations
                record = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[-1] if k != "finite"}
                record["lr"] = last_lr
                record["step_time"] = seconds / window_steps
                if window_tokens:
                    record["tokens_per_s"] = window_tokens / seconds
                if window_tokens and flops_per_token:
                    record["mfu"] = flops_per_token * window_tokens / seconds / peak_flops
                record["elapsed"] = time.perf_counter() - start
                log(step, record)
                pending, window_start, window_steps, window_tokens, window_paused = [], time.perf_counter(), 0, 0, 0.0
                if clock is not None:
                    agreed = clock(time.perf_counter() - start)
            roles_start = time.perf_counter()  # the steps are done: _check_finite above waited for them
            roles(step, state, lambda e, step=step: e.due(step), save_anyway=stopping)
            window_paused += time.perf_counter() - roles_start
            if stopping:
                raise Preempted(f"stopped by signal {stop_flag.signal} at step {step}")

        def at_end(e: Every) -> bool:
            return e.at_end and not e.due(step) and (e is not checkpoint or step != start_step)

        roles(step, state, at_end)
    return state, step, time.perf_counter() - start


def _run_due(
    step: int,
    state: Any,
    due: Callable[[Every], bool],
    log: Callable[[int, dict[str, float]], None],
    evaluate: Every | None,
    checkpoint: Every | None,
    save_anyway: bool = False,
) -> None:
    """Evaluate and then checkpoint with that evaluation's metrics, each when it is `due`."""
    evaluation = None
    if evaluate is not None and due(evaluate):
        evaluation = evaluate.fn(step, state)
        if evaluation:
            log(step, evaluation)
    if checkpoint is not None and (save_anyway or due(checkpoint)):
        checkpoint.fn(step, state, evaluation)


class NonFiniteLoss(UserError):
    pass


def _check_finite(pending: list[dict[str, Any]], step: int) -> None:
    flags = jax.device_get([m["finite"] for m in pending])
    for i, ok in enumerate(flags):
        if not bool(ok):
            bad = step - len(pending) + i + 1
            raise NonFiniteLoss(f"the loss became NaN or infinite at step {bad}")
