"""Custom-analysis code shipped to workers lands in one folder per version of the code, shared by a user's
workers on a machine: a killed worker (every worker, at the end of a job) left a folder of its own in the
temporary folder before, one per worker per job."""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile

import pytest

from actlake.jobs.extract.worker import code_folder

FILES = {"mine/__init__.py": b"", "mine/counts.py": b"WHO = 'counts v1'\n"}


@pytest.fixture
def system_tmp(tmp_path, monkeypatch):
    d = tmp_path / "system-tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _contents(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_one_folder_per_version_of_the_code(system_tmp):
    first = code_folder(FILES)
    assert code_folder(dict(FILES)) == first  # a second worker, a second job
    assert _contents(first) == FILES
    changed = code_folder({**FILES, "mine/counts.py": b"WHO = 'counts v2'\n"})
    assert changed != first and _contents(changed)["mine/counts.py"] == b"WHO = 'counts v2'\n"
    assert sorted(p.name for p in system_tmp.iterdir()) == sorted([first.name, changed.name])
    assert oct(first.stat().st_mode & 0o777) == oct(0o700)


def test_files_written_there_at_run_time_do_not_unshare_it(system_tmp, caplog):
    folder = code_folder(FILES)
    subprocess.run([sys.executable, "-c", "import mine.counts"], cwd=folder, check=True,
                   env={"PYTHONPATH": str(folder), "PATH": "/usr/bin:/bin"})
    assert any(p.suffix == ".pyc" for p in folder.rglob("*"))
    (folder / "mine" / "cache.json").write_text("{}")  # an analysis's own cache beside its module
    with caplog.at_level(logging.WARNING, logger="actlake.worker"):
        assert code_folder(FILES) == folder
    assert caplog.text == "" and (folder / "mine" / "cache.json").exists()


def test_a_damaged_shared_folder_is_written_again(system_tmp, caplog):
    shared = code_folder(FILES)
    (shared / "mine" / "counts.py").write_bytes(b"WHO = 'edited'\n")
    (shared / "mine" / "__init__.py").unlink()  # removed by a cleaner of old files
    with caplog.at_level(logging.WARNING, logger="actlake.worker"):
        assert code_folder(FILES) == shared
    assert _contents(shared) == FILES and len(list(system_tmp.iterdir())) == 1
    assert f"{shared}: mine/__init__.py, mine/counts.py differed from the job's custom code; written again" in caplog.text


def test_a_shared_folder_others_may_write_in_is_not_used(system_tmp, caplog):
    shared = code_folder(FILES)
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="actlake.worker"):
        private = code_folder(FILES)
    assert private != shared and _contents(private) == FILES
    assert f"{shared} is not this user's alone; using a private copy" in caplog.text


def test_a_path_out_of_the_folder_is_refused_and_nothing_stays(system_tmp):
    with pytest.raises(ValueError, match=r"custom code path escapes its folder: \.\./evil\.py"):
        code_folder({"../evil.py": b"print('escaped')\n"})
    assert list(system_tmp.iterdir()) == []
    assert not (system_tmp.parent / "evil.py").exists()


def test_the_driver_imports_a_custom_analysis_without_putting_its_folder_on_sys_path(tmp_path):
    """A file beside the custom analysis named like a module the driver imports later (psutil) must not run: the
    folder was put first on sys.path."""
    import subprocess
    import sys

    (tmp_path / "psutil.py").write_text("print('HIJACKED')\n")
    (tmp_path / "mine.py").write_text("VALUE = 42\n")
    code = ("import sys, types\nfrom actlake.jobs.extract.run import import_custom_analyses\n"
            f"c = types.SimpleNamespace(path={str(tmp_path / 'mine.py')!r}, analysis='mine:X')\n"
            "import_custom_analyses(types.SimpleNamespace(code_refs=[(('analyses', 'custom', 0), c.analysis, c.path)]))\n"
            "import mine, psutil\nprint(mine.VALUE, psutil.__name__, psutil.__file__.endswith('site-packages/psutil/__init__.py'))\n"
            f"print({str(tmp_path)!r} in sys.path)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["42", "psutil", "True", "False"], r.stdout + r.stderr
