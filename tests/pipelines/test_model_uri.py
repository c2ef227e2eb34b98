"""The one ``models:/`` grammar (pipelines.config.model_uri): parse and format round trips, the one error message
naming where the URI came from, and the value's own checks."""
from __future__ import annotations

import pytest

from pipelines.config.model_uri import ModelUri, is_model_uri, parse_model_uri


@pytest.mark.parametrize("text, expected", [
    ("models:/demo-er-01234567@task-3", ModelUri("demo-er-01234567", alias="task-3")),
    ("models:/demo-er-01234567/4", ModelUri("demo-er-01234567", "4")),
    ("models:/demo-er-01234567/latest", ModelUri("demo-er-01234567", "latest")),
    ("models:/team.retrieval_v2@champion", ModelUri("team.retrieval_v2", alias="champion")),
])
def test_parse_and_format_round_trip(text, expected):
    parsed = parse_model_uri(text)
    assert parsed == expected and str(parsed) == text and parsed.uri == text
    assert parse_model_uri(text + "/") == expected  # a trailing slash is accepted, formatted without it


def test_pinned_only_for_a_numbered_version():
    assert ModelUri("m", "12").pinned
    assert not ModelUri("m", "latest").pinned and not ModelUri("m", alias="champion").pinned
    assert ModelUri("m", alias="champion").at_version(7) == ModelUri("m", "7")


@pytest.mark.parametrize("text", ["models:/a/b/c", "models:/my-model:task-3", "models:/m", "models:/m@", "models:/@a",
                                  "models:/m/v1", "models:/m@a b", "runs:/0123/model", "", None])
def test_every_bad_uri_gets_the_one_message_naming_where_it_came_from(text):
    with pytest.raises(ValueError) as error:
        parse_model_uri(text, "replacements[1].source")
    assert str(error.value) == (f"replacements[1].source: {text!r} is not an MLflow model URI; expected "
                                f"models:/NAME@ALIAS (e.g. models:/my-model@task-3), models:/NAME/VERSION or "
                                f"models:/NAME/latest")
    with pytest.raises(ValueError, match=r"^model URI: "):
        parse_model_uri(text)


def test_the_value_refuses_what_the_grammar_refuses():
    with pytest.raises(ValueError, match="exactly one of version and alias"):
        ModelUri("m", "3", "champion")
    with pytest.raises(ValueError, match="exactly one of version and alias"):
        ModelUri("m")
    with pytest.raises(ValueError, match=r"model URI 'models:/m/x': expected"):
        ModelUri("m", "x")


def test_scheme_check():
    assert is_model_uri("models:/m@a") and is_model_uri("models:typo")
    assert not is_model_uri("runs:/x/y") and not is_model_uri(None) and not is_model_uri("s3://b/models:/x")
