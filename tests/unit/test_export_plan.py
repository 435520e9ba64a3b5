"""The token export's memory plan (jobs/export/tokens.py ``Plan``): bucket sizes drawn as the shuffle draws them
(each row to a uniformly random bucket), for narrow and wide rows, small and large budgets; the largest bucket plus
the carried rows twice and a shard's copy stay within ``--memory-mb``, and so does pass 1's read batch."""

from __future__ import annotations

import numpy as np
import pytest

from actlake.errors import ConfigError
from actlake.jobs.export.tokens import MAX_BUCKETS, Plan


@pytest.mark.parametrize("d, mb", [(64, 1), (64, 512), (2048, 8), (2048, 64), (16384, 40), (16384, 64), (16384, 512)])
def test_the_largest_of_the_random_buckets_fits_the_budget(d, mb):
    rng = np.random.default_rng(d + mb)
    budget = mb * 2**20
    for scale in (10, 200):  # data 10 and 200 times the budget (fewer and more buckets)
        rows = int(scale * budget / (4 * d + 20))
        plan = Plan.make(rows, d, mb, None)
        assert plan.buckets >= 10 and 4 * plan.read_rows * plan.row_bytes <= budget / 2
        for _ in range(300):
            largest = rng.multinomial(rows, np.full(plan.buckets, 1 / plan.buckets)).max()
            assert (largest + 3 * plan.shard_rows) * plan.row_bytes <= budget, (plan, largest)


def test_refusals_name_the_option_and_say_what_fits():
    with pytest.raises(ConfigError, match=r"--memory-mb: 0.001 MiB holds no shard of rows of 65556 bytes"):
        Plan.make(1000, 16384, 0.001, None)  # the default shard: --memory-mb named, not --shard-rows
    with pytest.raises(ConfigError, match=r"--shard-rows: 1,000 rows .* give at most 99 rows"):
        Plan.make(10_000, 16384, 50, 1000)
    assert Plan.make(10_000, 16384, 50, 99).shard_rows == 99  # the most it names fits
    with pytest.raises(ConfigError, match=r"cannot hold pass 1's smallest read batch .* give at least 32.1$"):
        Plan.make(10_000, 16384, 32, None)
    assert Plan.make(10_000, 16384, 32.1, None).read_rows == 64
    with pytest.raises(ConfigError, match=r"would need \d+ buckets .* \(at most 4096\); give at least ([\d,]+)") as e:
        Plan.make(int(2e9), 1024, 512, None)
    need = int(str(e.value).rsplit(" ", 1)[1].replace(",", ""))
    assert Plan.make(int(2e9), 1024, need, None).buckets <= MAX_BUCKETS  # the figure it gives is enough
