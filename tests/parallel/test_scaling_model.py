"""benchmarks/scaling_model.py: the simulated iteration against cases worked out by hand."""
import os
import sys

import pytest

from paths import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import scaling_model as sm  # noqa: E402

# three layers: data (no params), conv (bucket 1), fc (bucket 0, final first in backward)
FWD, BWD, REST = [0.1, 1.0, 0.5], [0.0, 2.0, 1.0], 0.4
COMPUTE = sum(FWD) + sum(BWD) + REST


def test_ring_seconds_is_2_n_minus_1_steps_of_a_latency_and_a_segment():
    assert sm.ring_seconds(8e6, 4, 1e-3, 1e6) == pytest.approx(6 * (1e-3 + 2.0))
    assert sm.ring_seconds(8e6, 1, 1e-3, 1e6) == 0.0
    assert sm.ring_bytes_sent(8e6, 4) == pytest.approx(12e6)


def test_none_and_blocking():
    buckets = [(4e6, 2), (2e6, 1)]
    args = dict(ranks=2, latency=0.0, bandwidth=1e6, cpu_per_byte=0.0)
    assert sm.iteration_time(FWD, BWD, REST, buckets, mode="none", **args) == pytest.approx(COMPUTE)
    # blocking: every bucket crosses after backward: 2 (N-1) S / (N B) each
    link = 4.0 + 2.0
    assert sm.iteration_time(FWD, BWD, REST, buckets, mode="blocking", **args) == pytest.approx(COMPUTE + link)


def test_thread_hides_what_fits_behind_backward_and_the_next_forward():
    # fc's bucket (1 s of link) leaves after fc's backward and has conv's backward (2 s) to
    # travel; conv's bucket (0.5 s) has the rest and the next forward up to conv (0.5 s)
    buckets = [(1e6, 2), (0.5e6, 1)]
    t = sm.iteration_time(FWD, BWD, REST, buckets, ranks=2, latency=0.0, bandwidth=1e6, cpu_per_byte=0.0)
    assert t == pytest.approx(COMPUTE)
    # conv's bucket needs 2 s: the next forward waits 2 - (rest + data forward) = 1.5 s at conv
    buckets = [(1e6, 2), (2e6, 1)]
    t = sm.iteration_time(FWD, BWD, REST, buckets, ranks=2, latency=0.0, bandwidth=1e6, cpu_per_byte=0.0)
    assert t == pytest.approx(COMPUTE + 2.0 - REST - FWD[0])


def test_the_transfer_s_cpu_slows_compute():
    buckets = [(1e6, 2), (0.5e6, 1)]
    args = dict(ranks=2, latency=0.0, bandwidth=1e6)
    free = sm.iteration_time(FWD, BWD, REST, buckets, cpu_per_byte=0.0, **args)
    # 0.25 us per byte sent at 1 MB/s: a quarter of a core while the link sends (1.5 s of it,
    # all of it beside compute)
    busy = sm.iteration_time(FWD, BWD, REST, buckets, cpu_per_byte=0.25e-6, **args)
    assert free == pytest.approx(COMPUTE)
    assert busy == pytest.approx(free + 0.25 * 1.5)
    # on a many-core node the thread takes one core's share of it
    shared = sm.iteration_time(FWD, BWD, REST, buckets, cpu_per_byte=0.25e-6, stolen=0.1, **args)
    assert free < shared < busy


@pytest.mark.parametrize("t_iter", [0.5, -1.0])
def test_an_efficiency_that_is_no_fraction_is_an_error(t_iter):
    with pytest.raises(ValueError, match="contradict"):
        sm.efficiency(1.0, t_iter)
    assert sm.efficiency(1.0, 2.0) == 0.5
