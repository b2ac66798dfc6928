"""`ahead.AheadCompiler`: a compilation that fails on its thread is left to the call; `drain` waits
for every compilation submitted."""

import gc
import threading
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


class _Slow(_Program):
    """A program whose ahead compilation ends when `go` is set."""

    def __init__(self):
        self.go, self.compiled = threading.Event(), False

    def lower(self, *args, **kw):
        self.go.wait(10)
        self.compiled = True
        return self

    def compile(self):
        return self


def test_drain_waits_for_every_submitted_compilation():
    ahead, program = AheadCompiler(threads=1), _Slow()
    ahead.submit(program, (jnp.zeros(2),), {"k": 1})
    threading.Timer(0.2, program.go.set).start()
    ahead.drain()
    assert program.compiled and not ahead.pending
