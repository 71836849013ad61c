import gc
import subprocess
import sys

import pytest

from bertforge import __version__
from bertforge.cli import main, run


def test_help_and_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"bertforge {__version__}"
    assert main([]) == 0
    assert "COMMAND" in capsys.readouterr().out


def test_module_entry_point_runs():
    r = subprocess.run([sys.executable, "-m", "bertforge", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("bertforge ")


def test_the_program_exits_with_its_heap_frozen(monkeypatch, capsys):
    """`bertforge` (cli.run) freezes what the command left alive before it exits, so that Python's shutdown does
    not collect it; `main`, which the tests call in-process, freezes nothing."""
    monkeypatch.setattr(sys, "argv", ["bertforge", "model", "info", "--model", "tiny"])
    gc.unfreeze()
    try:
        assert main(sys.argv[1:]) == 0 and gc.get_freeze_count() == 0
        with pytest.raises(SystemExit) as e:
            run()
        assert e.value.code == 0 and gc.get_freeze_count() > 0
        assert "parameters:" in capsys.readouterr().out
    finally:
        gc.unfreeze()


def test_model_info_counts_base_parameters(capsys):
    assert main(["model", "info", "--model", "base"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 110,106,428" in out  # BERT-Base with its pretraining heads, as the reference counts


def test_bad_input_is_one_line_without_traceback(tmp_path, capsys):
    assert main(["model", "info", "--model", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no config.json") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
def test_smoke_trains_and_reloads(tmp_path, capsys):
    assert main(["model", "smoke", "--model", "tiny", "--steps", "15", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    first, last = (float(line.split("loss ")[1]) for line in out.splitlines() if line.startswith("step"))
    assert last < first
    assert "reloaded outputs identical: True" in out
