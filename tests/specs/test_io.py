import pytest

from lorafleet.errors import InputError
from lorafleet.plans import DeploymentPlan
from lorafleet.specs.io import read_json_object, staged_directory


@pytest.mark.parametrize(
    "content,message", [(None, "no such file"), ("{", "not valid JSON"), ("[1]", "expected a JSON object")]
)
def test_bad_json_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "x.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InputError, match=message):
        read_json_object(path)


def test_a_directory_is_an_input_error_for_every_json_reader(tmp_path):
    with pytest.raises(InputError, match="is a directory"):
        DeploymentPlan.load(tmp_path)


def test_a_staged_directory_replaces_its_target_whole(tmp_path):
    target = tmp_path / "out" / "adapter"
    with staged_directory(target) as staging:  # a new target, its folder made
        (staging / "a.txt").write_text("first")
    assert [p.name for p in target.iterdir()] == ["a.txt"]
    (target.parent / ".adapter.partial").mkdir()  # left by a crash: cleared, not merged
    (target.parent / ".adapter.partial" / "stale.txt").write_text("half")
    with staged_directory(target) as staging:
        assert not any(staging.iterdir())
        (staging / "b.txt").write_text("second")
    assert [p.name for p in target.iterdir()] == ["b.txt"]  # the old directory's files are gone with it
    assert [p.name for p in target.parent.iterdir()] == ["adapter"]  # no staging, no old one left


def test_a_failed_staged_directory_leaves_the_old_target_and_no_half_directory(tmp_path):
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "a.txt").write_text("old")
    with pytest.raises(RuntimeError, match="cut short"), staged_directory(target) as staging:
        (staging / "b.txt").write_text("half")
        raise RuntimeError("cut short")
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"] and (target / "a.txt").read_text() == "old"
    assert [p.name for p in target.iterdir()] == ["a.txt"]


def test_a_file_in_the_staging_directorys_place_is_an_error_and_kept(tmp_path):
    (tmp_path / ".adapter.partial").write_text("in the way")
    with pytest.raises(FileExistsError), staged_directory(tmp_path / "adapter"):
        pass
    assert (tmp_path / ".adapter.partial").read_text() == "in the way" and not (tmp_path / "adapter").exists()
