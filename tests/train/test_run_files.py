"""Run-folder JSONL files: a corrupt line is an error that names the file and the line; only an
unterminated last line (a crash in the middle of an append) is dropped, with a warning."""
import pytest

from fasttrain.train.run_files import CorruptRunFile, append_jsonl, read_jsonl


def test_a_corrupt_line_is_an_error_naming_file_and_line(tmp_path):
    f = tmp_path / "metrics.jsonl"
    for step in (1, 2, 3):
        append_jsonl(f, {"step": step})
    lines = f.read_text().splitlines()
    lines[1] = '{"step": 2, "kl": '                       # damaged in the middle of the file
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorruptRunFile, match=r"metrics\.jsonl: line 2 is not JSON"):
        read_jsonl(f)


def test_an_interrupted_last_append_is_dropped_with_a_warning(tmp_path):
    f = tmp_path / "samples.jsonl"
    append_jsonl(f, {"step": 1})
    append_jsonl(f, {"step": 2})
    with open(f, "a") as h:
        h.write('{"step": 3, "answ')                      # the process died mid-write
    with pytest.warns(UserWarning, match=r"samples\.jsonl: line 3 was cut short"):
        assert read_jsonl(f) == [{"step": 1}, {"step": 2}]
    assert read_jsonl(tmp_path / "absent.jsonl") == []
