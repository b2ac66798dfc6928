"""RedKnot requests decoding as rows of one batch (issue #46): `DecodeBatch`.

A RedKnot request's `DecodeState` (`decode.py`) decodes alone: one jitted call per layer for one
new row. A `DecodeBatch` holds the decode states of up to `slots` requests stacked on a leading
axis, every array padded to the members' common sizes (decode layouts rebuilt to
`layout.max_sizes`, compact rows, online entries and fence caches padded with zeros, which no
row reads: padding entries close after every real row), so a step is one jitted call per layer
for every member's new row: fences natively over the stacked caches, reusable layers by
`programs.reusable_step_batch_jit` (the attention vmapped, the MoE once over the rows), one head.
Requests join (`join`) and leave (`leave`) between steps, as the plain batch's slots do; a free
slot's row is computed and ignored. A joining request larger than the batch in some size pads
every member to it once; shapes otherwise stay, so steps compile nothing new.

Every member reads one pool (the server's device arena). Native states (the Recomputed or prefix
arm's, a fallback's: every layer a cache) form batches of their own, every layer stepped over the
stacked caches; a batch holds one kind or the other.
"""

from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp

from redknot_jax.model import block_jit, logits_jit
from redknot_jax.reuse.decode import DecodeState
from redknot_jax.reuse.layout import max_sizes
from redknot_jax.reuse.programs import decode_entries_jit, reusable_step_batch_jit


def _fit(a: jax.Array, shape) -> jax.Array:
    """a padded with zeros at the end of each axis to `shape`."""
    if tuple(a.shape) == tuple(shape):
        return a
    return jnp.pad(a, [(0, n - m) for m, n in zip(a.shape, shape)])


@functools.partial(jax.jit, donate_argnums=(0,))
def _put(stacked, one, slot):
    """Member `slot` of each stacked array [slots, ...] set to `one`'s array."""
    return jax.tree.map(lambda s, o: s.at[slot].set(o.astype(s.dtype)), stacked, one)


class DecodeBatch:
    """Decode states of up to `slots` RedKnot requests stepped together (module doc) by the
    `consumer` that prefilled them."""

    def __init__(self, consumer, slots: int):
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"DecodeBatch: slots must be an int >= 1, got {slots!r}")
        self.consumer, self.slots = consumer, slots
        self.members: list[DecodeState | None] = [None] * slots
        self._empty()

    def _empty(self) -> None:
        self.native: bool | None = None  # whether the members are native states (None: no member)
        self.pool = None
        self.sizes: dict | None = None  # the members' decode layouts' common padded sizes
        self.tables = None  # the members' decode layouts, stacked [slots, ...]
        self.layers: dict = {}  # per layer the members' caches (fences) or compact rows and entries, stacked

    @property
    def size(self) -> int:
        """Members now."""
        return sum(s is not None for s in self.members)

    def nbytes(self) -> int:
        """Device bytes the batch holds (stacked states and layouts; not the pool)."""
        return int(sum(x.nbytes for x in jax.tree.leaves((self.layers, self.tables))))

    def join(self, state: DecodeState) -> int:
        """Take `state` (from a consumer prefill with `decode_rows`: a RedKnot state, or a native
        one into a batch of native states) into a free slot and return the slot; its rows live in
        the batch from now on (`state.layers` emptied, `state.batch` set). ValueError, naming
        why, for a state that cannot join."""
        why = (f"it is {'native' if state.native else 'a RedKnot state'}; the batch's members are "
               f"{'native' if self.native else 'RedKnot states'}" if self.native not in (None, state.native) else
               "it has no decode layout" if not state.native and (state.layout is None or state.plan is None) else
               "it joined a batch already" if state.batch is not None else
               "it has no room for another row" if not state.room else
               "it reads another pool than the batch's members" if self.pool is not None and
               state.pool is not self.pool else
               f"all {self.slots} slots are taken" if None not in self.members else None)
        if why:
            raise ValueError(f"DecodeBatch.join: {why}")
        c, slot = self.consumer, self.members.index(None)
        self.pool, self.native = state.pool, state.native
        tables, put = None, False
        if not state.native:
            sizes = max_sizes(state.layout.sizes(), *([self.sizes] if self.sizes else []))
            tables = self._layout(state, sizes)
            put = sizes == self.sizes  # else every member's layout padded to the new sizes, this slot's too
            if not put:  # (a free slot's: a copy of the joining member's), in one transfer
                per = [tables if s is None else self._layout(s, sizes) for s in self.members]
                self.tables = jax.device_put(jax.tree.map(lambda *a: np.stack(a), *per))
                self.sizes = sizes
            tables = jax.device_put(tables)
        one = {}
        for i, keys in state.layers.items():
            if state.native or c.profile.is_fence(i, c.cfg.num_layers):
                one[i] = jax.tree.map(lambda a: a[0], keys)  # the cache without its batch axis
            elif not state.stepped:  # the request's online entries, pooled once (a decode step's first work)
                gd, st = c.defs[i]
                one[i] = decode_entries_jit(st, keys, tables, state.pool.layers[i], graphdef=gd,
                                            freqs=c.model.freqs(i))
            else:
                one[i] = keys
        if not self.layers:  # the first member: every slot's arrays shaped after its own
            self.layers = {i: jax.tree.map(lambda a: jnp.zeros((self.slots,) + a.shape, a.dtype), v)
                           for i, v in one.items()}
        for i, v in one.items():  # each array padded to the larger of the batch's and the member's
            shapes = jax.tree.map(lambda s, a: tuple(max(p, q) for p, q in zip(s.shape[1:], a.shape)),
                                  self.layers[i], v)
            self.layers[i] = jax.tree.map(lambda s, sh: _fit(s, (self.slots,) + sh), self.layers[i], shapes)
            one[i] = jax.tree.map(_fit, v, shapes)
        self.layers = _put(self.layers, one, jnp.int32(slot))
        if put:
            self.tables = _put(self.tables, tables, jnp.int32(slot))
        state.layers, state.batch, state.stepped = {}, self, True
        self.members[slot] = state
        return slot

    def leave(self, slot: int) -> None:
        """Free `slot` (its state is spent); an empty batch drops its arrays."""
        if not 0 <= slot < self.slots or self.members[slot] is None:
            raise ValueError(f"DecodeBatch.leave: slot {slot} holds no member")
        self.members[slot] = None
        if not self.size:
            self._empty()

    def step(self, tokens) -> jax.Array:
        """One generated token per slot appended to its member (a free slot's token is ignored):
        logits [slots, vocab] of the next row (a free slot's row is meaningless). Each member's
        equal `Consumer.decode_step` of its state alone."""
        c = self.consumer
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        if tokens.size != self.slots:
            raise ValueError(f"DecodeBatch.step: one token per slot ({self.slots}), got {tokens.size}")
        if not self.size:
            raise ValueError("DecodeBatch.step: the batch has no member")
        t0, live = np.zeros(self.slots, np.int32), np.zeros(self.slots, np.int32)
        for b, s in enumerate(self.members):
            if s is None:
                continue
            if not s.room or (not s.native and int(s.layout.own_slot[s.rows]) != s.own):
                raise RuntimeError(f"DecodeBatch.step: slot {b} has no room for row {s.rows}" if not s.room else
                                   f"DecodeBatch.step: slot {b}'s row {s.rows} would be compact row "
                                   f"{int(s.layout.own_slot[s.rows])}, expected {s.own}")
            t0[b], live[b] = s.rows, 1
        ids = jnp.asarray(tokens.reshape(-1, 1))
        pos, n_new = jnp.asarray(t0), jnp.asarray(live)
        x = c._embed(ids)
        for i in range(c.cfg.num_layers):
            gd, st = c.defs[i]
            if self.native or c.profile.is_fence(i, c.cfg.num_layers):
                x, self.layers[i] = block_jit(st, x, ids, pos, n_new, self.layers[i], graphdef=gd,
                                              freqs=c.model.freqs(i), block=1)
            else:
                x, self.layers[i] = reusable_step_batch_jit(st, x, ids, self.tables, self.pool.layers[i],
                                                            self.layers[i], pos, graphdef=gd,
                                                            freqs=c.model.freqs(i), fan=c.fan)
        for s in self.members:
            if s is not None:
                s.rows += 1
                s.own += not s.native
        return logits_jit(c.top_state, x, jnp.zeros((self.slots, 1), jnp.int32), graphdef=c.top_def)[:, 0]

    # ------------------------------------------------------------------ pieces
    def _layout(self, state: DecodeState, sizes: dict) -> dict:
        """The member's decode layout tables padded to `sizes` (its compact rows unchanged), on the host."""
        lay = self.consumer._layout(state.plan, state.pool, sizes, place=False)
        if not np.array_equal(lay.own_slot[:lay.n_real], state.layout.own_slot[:lay.n_real]):
            raise AssertionError("DecodeBatch: padding a decode layout moved its compact rows")
        return lay.tables
