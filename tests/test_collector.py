"""The garbage collector during a training run (runtime/collector.py): what lives through the run's start is left out
of later collections, garbage is still freed before and after, and nothing stays frozen once the run ends."""

from __future__ import annotations

import gc
import weakref

import jax.numpy as jnp
import pytest

from bertforge.runtime import collector
from bertforge.train import loop


class Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def cycle() -> weakref.ref:
    """A weak reference to a new cycle that nothing else holds (garbage for the cyclic collector)."""
    return weakref.ref(Node())


def tracked(obj: object) -> bool:
    """Whether the collector's generations (not the permanent one) hold `obj`."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture(autouse=True)
def nothing_frozen():
    gc.unfreeze()
    yield
    assert gc.get_freeze_count() == 0
    gc.unfreeze()


def test_settled_frees_garbage_first_then_keeps_the_rest_out_of_collections_until_the_end():
    before, kept = cycle(), Node()
    with collector.settled() as settle:
        assert before() is None  # freed on entry, not frozen with the rest
        assert gc.get_freeze_count() > 0 and not tracked(kept)
        made_inside = cycle()
        gc.collect()
        assert made_inside() is None  # later garbage is collected as before
        held = Node()
        settle()
        assert not tracked(held)
        released = weakref.ref(held)
        del held  # garbage now, but frozen: no collection frees it while the run goes on
        gc.collect()
        assert released() is not None
    assert gc.get_freeze_count() == 0 and tracked(kept)
    gc.collect()
    assert released() is None  # collectable again once the run ended


def test_settled_leaves_alone_what_someone_else_froze():
    gc.freeze()
    frozen = gc.get_freeze_count()
    with collector.settled() as settle:
        settle()
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen  # theirs stays frozen
    gc.unfreeze()


def test_the_loop_settles_after_its_first_step_and_after_an_evaluation_and_unfreezes_at_the_end():
    seen: list[tuple[int, bool]] = []
    made: list[Node] = []

    def step_fn(state, batch, lr):
        made.append(Node())
        seen.append((len(made), all(not tracked(n) for n in made[:-1])))
        return state, {"loss": jnp.float32(1.0), "finite": jnp.bool_(True)}

    evaluate = loop.Every(3, lambda step, state: made.append(Node()) or None)
    loop.run(None, step_fn, next_batch=lambda _: None, lr_at=lambda p: 1.0, budget=loop.Budget(max_steps=5),
             log=lambda s, m: None, log_every=10, evaluate=evaluate)  # fmt: skip
    # Objects 1 (step 1) and 4 (the evaluation after step 3) are the last made before a settle: step 2 sees
    # object 1 frozen, step 3 object 2 young; step 4 sees everything up to the evaluation's frozen, step 5 not
    # step 4's.
    assert seen == [(1, True), (2, True), (3, False), (5, True), (6, False)]
    assert gc.get_freeze_count() == 0 and all(tracked(n) for n in made)


def test_a_command_collects_its_young_objects_less_often():
    saved = gc.get_threshold()
    try:
        collector.for_command()
        assert gc.get_threshold() == (collector.COMMAND_THRESHOLD, *saved[1:])
    finally:
        gc.set_threshold(*saved)
