"""The counter-based Gaussian of IVON's fused CPU loops: its statistics, its counters, and the engine drawing it."""

import math

import numpy as np
import pytest
import scipy.stats
import torch

from helpers import skip_without_fused_kernels
from varsmooth.posterior import VariationalIVON, derive_seed
from varsmooth.posterior.noise import COUNTER_LIMIT, counter_key, counter_normal

N = 1 << 20


def _draw(seed, n=N, start=0):
    return counter_normal((n,), counter_key(seed, start)).double().numpy()


def test_draws_are_standard_normal():
    z = _draw(derive_seed(0, 1, 2))
    assert abs(z.mean()) < 5 / math.sqrt(N)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / N)
    assert scipy.stats.kstest(z, "norm").pvalue > 1e-3
    for tail in (1.0, 2.0, 3.0, 4.0):  # two-sided tail frequencies, within 5 binomial standard deviations
        p = 2 * scipy.stats.norm.sf(tail)
        assert abs((np.abs(z) > tail).mean() - p) < 5 * math.sqrt(p * (1 - p) / N), tail
    assert np.isfinite(z).all() and np.abs(z).max() < 6.0  # 24-bit uniforms: |z| <= sqrt(2 ln 2^24) ≈ 5.8


def _corr(a, b):
    return float(np.corrcoef(a, b)[0, 1])


def test_neighbours_and_related_keys_are_uncorrelated():
    seed = derive_seed(5)
    z = _draw(seed)
    bound = 5 / math.sqrt(N)
    for lag in (1, 2, 16, 1024):
        assert abs(_corr(z[:-lag], z[lag:])) < bound, lag
    # neighbouring counters of derive_seed, and keys one bit apart in the first word (bit 0) or the second (bit 39)
    for other in (derive_seed(6), derive_seed(5, 0), seed ^ 1, seed ^ 1 << 39):
        assert abs(_corr(z, _draw(other))) < bound
        assert abs(_corr(z ** 2, _draw(other) ** 2)) < 2 * bound  # no dependence in the magnitudes either


def test_keys_that_differ_in_the_first_word_do_not_permute_one_stream():
    """Were the counter to enter only through the key's first word, keys differing there by d would give the same
    values at counters c and c ^ d."""
    seed = derive_seed(9)
    z = _draw(seed)
    counters = np.arange(N)
    for d in (1, 2, 255, 1 << 12):
        assert abs(_corr(_draw(seed ^ d), z[counters ^ d])) < 5 / math.sqrt(N), d


def test_a_start_counter_continues_the_same_stream():
    seed = derive_seed(3)
    whole = _draw(seed, 1000)
    assert np.array_equal(_draw(seed, 300, start=700), whole[700:])
    two_d = counter_normal((10, 100), counter_key(seed)).numpy()
    assert np.array_equal(two_d.ravel(), whole.astype(np.float32))  # row-major order


def test_counters_out_of_range_are_refused():
    with pytest.raises(ValueError, match="start=.*outside"):
        counter_key(0, start=COUNTER_LIMIT)
    with pytest.raises(ValueError, match="exceed"):
        counter_normal((COUNTER_LIMIT + 1,), counter_key(0))


@pytest.fixture
def fused_everywhere(monkeypatch):
    import varsmooth.posterior.optimizer as engine

    skip_without_fused_kernels()
    monkeypatch.setattr(engine, "FUSED_MIN_NUMEL", 0)


def test_fused_loop_computes_the_documented_noise(fused_everywhere):
    """The noise the compiled loop leaves in its buffer is counter_normal of the documented key: the vectorised
    loop agrees with the eager formula to float32 rounding of the logarithm and cosine."""
    weight = torch.nn.Parameter(torch.zeros(257, 129))
    bias = torch.nn.Parameter(torch.zeros(5))
    opt = VariationalIVON([weight, bias], lr=0.1, ess=100.0, noise_seed=11, rank=2, fused=True)
    for draw in range(2):
        with opt.sampled_params():
            for index, p in enumerate((weight, bias)):
                expected = counter_normal(p.shape, counter_key(derive_seed(11, 2, 0, draw, index)))
                torch.testing.assert_close(opt._buffers[p]["noise"], expected, atol=2e-6, rtol=0)


def test_fused_noise_without_a_seed_follows_the_global_rng(fused_everywhere):
    """noise_seed=None: the keys come from torch's global RNG, so torch.manual_seed reproduces the draw."""
    def draw(seed):
        torch.manual_seed(seed)
        weight = torch.nn.Parameter(torch.zeros(64, 64))
        opt = VariationalIVON([weight], lr=0.1, ess=100.0, noise_seed=None, fused=True)
        with opt.sampled_params():
            return weight.detach().clone()

    assert torch.equal(draw(0), draw(0))
    assert not torch.equal(draw(0), draw(1))
