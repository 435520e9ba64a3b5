"""Durations as a person reads them, for progress lines of every job."""


def hms(seconds: float) -> str:
    """``HH:MM:SS`` (hours past 24 kept: ``27:46:40``), rounded to the second."""
    s = max(0, round(seconds))
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"
