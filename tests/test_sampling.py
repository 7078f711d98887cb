"""The sampler never turns a request's parameters into NaN probabilities: temperatures too small
to divide by are greedy, non-finite ones are refused in one line."""

import numpy as np
import pytest

from dsv4c.errors import UsageError
from dsv4c.runtime.sampling import GREEDY_TEMPERATURE, Sampler, SamplingParams

LOGITS = np.array([0.5, 3.0, -2.0, 2.999], np.float32)


@pytest.mark.parametrize("temperature", [0.0, 1e-310, 5e-324, GREEDY_TEMPERATURE / 2])
def test_temperatures_below_the_greedy_line_take_the_argmax(temperature):
    params = SamplingParams(temperature=temperature, top_p=0.5, seed=3)
    assert params.greedy
    assert [Sampler(params)(LOGITS) for _ in range(5)] == [1] * 5


def test_the_smallest_sampled_temperature_gives_a_finite_distribution():
    sampler = Sampler(SamplingParams(temperature=GREEDY_TEMPERATURE, seed=3))
    probs = sampler.probs(np.array([0.0, 80.0, -80.0], np.float32))
    assert np.all(np.isfinite(probs)) and probs.sum() == pytest.approx(1.0) and sampler(LOGITS) in range(4)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1e-310, -1.0])
def test_non_finite_or_negative_temperatures_are_refused(temperature):
    with pytest.raises(UsageError, match="temperature must be a finite number >= 0") as e:
        SamplingParams(temperature=temperature)
    assert "\n" not in str(e.value)
