"""`ahead.AheadCompiler`: a compilation that fails on its thread is left to the call."""

import gc
import weakref

import jax.numpy as jnp

from redknot_jax.ahead import AheadCompiler


class _Program:
    """A jitted function's surface (`lower(...).compile()`, a call) whose ahead compilation
    fails, as XLA's autotuner does when it finds no device memory beside the requests in flight."""

    def lower(self, *args, **kw):
        raise RuntimeError("All configs failed during profiling")

    def __call__(self, x, *, k):
        return x + k


def test_a_failed_ahead_compile_is_left_to_the_call_and_keeps_no_argument():
    ahead, program = AheadCompiler(threads=1), _Program()
    x = jnp.arange(4.0)
    ahead.submit(program, (x,), {"k": 1})
    assert ahead(program, (x,), {"k": 1}).tolist() == [1.0, 2.0, 3.0, 4.0]  # the call ran (and compiled) it
    assert not ahead.pending
    held = weakref.ref(x)
    del x
    gc.collect()
    assert held() is None  # no exception's traceback holds the call's arrays
