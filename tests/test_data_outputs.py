"""data.outputs: output paths checked before the work; files written under a temporary name."""

import pytest

from meshlm.data.outputs import check_output_file, replacing
from meshlm.errors import ConfigError


def test_a_writable_path_passes_and_its_folders_are_made(tmp_path):
    path = tmp_path / "a" / "b" / "out.json"
    check_output_file(str(path), "--output x")
    assert path.parent.is_dir() and list(path.parent.iterdir()) == []


def test_directories_and_files_in_the_way_are_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=f"^--output x: {tmp_path} is a directory"):
        check_output_file(str(tmp_path), "--output x")
    with pytest.raises(ConfigError, match=f"^--output x: {tmp_path / 'f'} is a file, not a folder"):
        check_output_file(str(tmp_path / "f" / "g" / "out.json"), "--output x")


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_replacing_leaves_nothing_on_error(tmp_path, error):
    path = tmp_path / "out.json"
    with pytest.raises(error):
        with replacing(str(path)) as tmp:
            open(tmp, "w").write("half")
            raise error
    assert list(tmp_path.iterdir()) == []


def test_replacing_moves_the_file_into_place(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with replacing(str(path)) as tmp:
        open(tmp, "w").write("new")
    assert path.read_text() == "new" and list(tmp_path.iterdir()) == [path]
