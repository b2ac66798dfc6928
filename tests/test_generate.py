"""Sampling, stop tokens and request validation of the Engine; its layer programs shared across
engines and compiled ahead on threads."""

import threading

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from redknot_jax import config
from redknot_jax.generate import Engine, SamplingParams, bucket, sample
from redknot_jax.init import random_model
from redknot_jax.server.metrics import compiled_programs, count_compiled_programs


def test_greedy_and_nucleus():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    assert int(sample(logits, jax.random.key(0), 0.0, 1.0)[0]) == 0
    draws = [int(sample(logits, jax.random.key(i), 1.0, 0.7)[0]) for i in range(300)]
    assert set(draws) == {0, 1}  # the nucleus of mass 0.7 is {0, 1}
    assert 0.5 < draws.count(0) / len(draws) < 0.75  # renormalised 0.5 / 0.8 = 0.625
    full = [int(sample(logits, jax.random.key(i), 1.0, 1.0)[0]) for i in range(600)]
    assert 3 in full  # top_p = 1 keeps the tail


def test_temperature_sharpens():
    logits = jnp.array([[1.0, 0.0]])
    cold = [int(sample(logits, jax.random.key(i), 0.1, 1.0)[0]) for i in range(100)]
    assert cold.count(0) >= 99


@pytest.mark.parametrize("kw,needle", [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
                                       (dict(top_p=1.5), "top_p"), (dict(max_new_tokens=-1), "max_new_tokens")])
def test_bad_sampling_params(kw, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)


@pytest.fixture(scope="module")
def engine():
    return Engine(random_model(config.tiny("csa"), seed=1, dtype=jnp.float32), capacity=128, block=16)


def test_stop_tokens_end_a_sequence(engine):
    prompts = [[5, 6, 7, 8], [9, 10]]
    free = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    stop = free.tokens[0][2]
    cut = engine.generate(prompts, SamplingParams(max_new_tokens=6, stop_tokens=(stop,)))
    assert cut.tokens[0] == free.tokens[0][: free.tokens[0].index(stop) + 1]


def test_engines_share_their_layer_programs(engine):
    """Prefill and decode run per-layer programs keyed by a hashed graphdef (`model.HashedDef`):
    a second Engine over an equal model lowers nothing new."""
    count_compiled_programs()
    prompts = [[5, 6, 7], [8, 9]]
    first = engine.generate(prompts, SamplingParams(max_new_tokens=3))
    n = compiled_programs()
    again = Engine(engine.model, capacity=128, block=16).generate(prompts, SamplingParams(max_new_tokens=3))
    assert again.tokens == first.tokens and compiled_programs() == n


def test_layer_programs_compile_ahead_on_threads(engine, monkeypatch):
    """`Engine(compile_threads=2)`: a prefill chunk's and a decode step's layer programs compile on
    the ahead threads, none where a layer calls them; the tokens and logits are bitwise those of
    an engine compiling in turn, and a second request of the same shapes submits nothing. A
    cache of 160 positions: programs no other test compiles."""
    from jax._src import compiler
    where, compile_or_get = [], compiler.compile_or_get_cached

    def spy(backend, computation, *a, **k):
        name = str(computation.operation.attributes["sym_name"]).strip('"')
        where.append((name, threading.current_thread().name.startswith("ahead-compile")))
        return compile_or_get(backend, computation, *a, **k)

    monkeypatch.setattr(compiler, "compile_or_get_cached", spy)
    prompts, params = [[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=2)
    ahead = Engine(engine.model, capacity=160, block=16, compile_threads=2)
    got = ahead.generate(prompts, params)
    layers = [on_thread for name, on_thread in where if name == "jit_block_jit"]
    assert len(layers) >= 2 and all(layers), where  # a prefill chunk's and a decode step's
    want = Engine(engine.model, capacity=160, block=16).generate(prompts, params)
    assert got.tokens == want.tokens
    np.testing.assert_array_equal(got.first_logits, want.first_logits)
    submitted = []
    monkeypatch.setattr(ahead.ahead, "submit", lambda *a: submitted.append(a))
    assert ahead.generate(prompts, params).tokens == got.tokens and submitted == [] and not ahead.ahead.pending


def test_bad_prompts_are_named(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.prefill([[1, 2], []])
    with pytest.raises(ValueError, match="outside"):
        engine.prefill([[1, 10_000]])
    with pytest.raises(ValueError, match="capacity"):
        engine.prefill([[1] * 200])


def test_bucket():
    assert [bucket(n) for n in (1, 16, 17, 100, 256, 257)] == [16, 16, 32, 128, 256, 512]
