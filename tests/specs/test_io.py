import pytest

from lorafleet.errors import InputError
from lorafleet.plans import DeploymentPlan
from lorafleet.specs.io import read_json_object


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
