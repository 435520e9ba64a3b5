"""The progress ETA leaves out the start-up (issue 53: the quick start's first ETA was 5x too long, start-up
counted as if every document cost it again)."""

import io

from actlake.jobs.extract import progress
from actlake.jobs.extract.progress import Progress


def test_the_eta_is_measured_from_the_first_documents(monkeypatch):
    """30 s of start-up, then 10 documents a second: at every count the ETA is the time really left."""
    clock = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    p = Progress(total_docs=400, shards=8, stream=io.StringIO())
    clock[0] = 30.0  # Ray, the workers, the model's load: no documents yet
    p.tick((0, 0, 0))
    assert p._eta() == ""
    for t in (31.0, 35.0, 50.0):  # documents from 30 s on, 10 a second
        clock[0] = t
        p.tick((10 * (t - 30.0), 1000, 1))
        if t == 31.0:
            assert p._eta() == ""  # one count: no rate yet
        else:
            left = (400 - 10 * (t - 30.0)) / 10
            h, m, s = map(int, p._eta().split(":"))
            assert abs(3600 * h + 60 * m + s - left) <= 1, (t, p._eta(), left)
    p.close()
