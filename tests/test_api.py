"""The package's lazy public API and version."""

import pytest

import lorafleet


@pytest.mark.parametrize("name", [n for n in lorafleet.__all__ if n != "__version__"])
def test_public_names_resolve(name):
    assert callable(getattr(lorafleet, name))


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError):
        lorafleet.not_a_function  # noqa: B018


def test_version_matches_cli(capsys):
    from lorafleet.cli import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"lorafleet {lorafleet.__version__}"
