"""Compile ahead: a call's distinct jitted programs compiled side by side in threads before
their first calls (the reuse consumer's layers, `Consumer(compile_threads=)`; the plain engine's,
`Engine(compile_threads=)`), where the caller would compile them one after another as it reaches
them. XLA's compilation releases the GIL, so the threads compile in parallel."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait

import jax


class AheadCompiler:
    """Programs compiled side by side in `threads` threads before their first calls:
    `submit(fn, args, kw)` once the arguments' shapes are known (the call's own
    arguments, or `jax.ShapeDtypeStruct`s, with a sharding only where the call's arrays will be
    committed to one: else the lowering differs), `__call__(fn, args, kw)` to run
    a program, waiting for its compilation first (a program compiled once: XLA's compilation
    cache serves the call). A compilation that fails ahead leaves the program to the call, which
    compiles it again (a compile error then raises there, in the caller's thread): the thread
    keeps no exception, whose traceback would hold the call's arguments (device arrays) for the
    life of the process, and a transient failure (XLA's autotuner finding no device memory beside
    the requests in flight) is not repeated for every later call. `drain()` waits for every
    compilation submitted (the autotuner's device memory returned). threads=0: calls only. `first(sig)`:
    whether a request of this signature (its arm and shapes) is the first, so that later ones
    spend no host time on submitting (a signature that misses a shape only leaves that program
    to compile at its call)."""

    def __init__(self, threads: int = 0):
        if not isinstance(threads, int) or threads < 0:
            raise ValueError(f"AheadCompiler: threads must be an int >= 0, got {threads!r}")
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="ahead-compile") if threads else None
        self.jobs: dict = {}
        self.signatures: set = set()
        self.pending = False  # any job not yet waited for (else a call computes no key)

    def first(self, sig) -> bool:
        if self.pool is None or sig in self.signatures:
            return False
        self.signatures.add(sig)
        return True

    @staticmethod
    def _key(fn, args, kw):
        def spec(x):  # what the lowering sees: a placement only where the array is committed to one
            if isinstance(x, jax.ShapeDtypeStruct):
                return x.shape, x.dtype, x.weak_type, x.sharding
            a = jax.typeof(x)
            return a.shape, a.dtype, a.weak_type, x.sharding if getattr(x, "committed", False) else None
        leaves, tree = jax.tree.flatten(args)
        return fn, tree, tuple(map(spec, leaves)), tuple(sorted(kw.items()))

    def submit(self, fn, args: tuple, kw: dict) -> None:
        if self.pool is None:
            return
        key = self._key(fn, args, kw)
        if key not in self.jobs:
            def compile_only():  # the executable is kept by XLA's compilation cache, not here
                try:
                    fn.lower(*args, **kw).compile()
                except Exception:  # nothing kept (see the class doc): the call compiles it
                    pass
            self.jobs[key] = self.pool.submit(compile_only)
            self.pending = True

    def __call__(self, fn, args: tuple, kw: dict):
        if self.pending:
            job = self.jobs.get(self._key(fn, args, kw))
            if job is not None:
                job.result()
            self.pending = not all(j.done() for j in self.jobs.values())
        return fn(*args, **kw)

    def drain(self) -> None:
        wait(list(self.jobs.values()))
        self.pending = False
