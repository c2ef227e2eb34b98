"""The search service's API reference, read from a real `compat serve` process (real Ray Serve, a real MLflow
registry, HTTP on 127.0.0.1): /openapi.json lists exactly the request fields the parser accepts and every field of
the real answers, each of its examples is answered with 200, the model_version rules it states are what the service
does, and /docs is a self-contained HTML page naming every field."""
from __future__ import annotations

import re
import subprocess
import time

import pytest
import serving_helpers as helpers
from local_services import free_port
from user_shell import PYTHON, user_env

from app.cli import main
from cluster.serving.app import ROUTES
from compat_core.retrieval.search_request import FIELDS, MODEL_VERSION_RULES

pytestmark = pytest.mark.integration
NAME = "serve-api-docs-test"


@pytest.fixture(scope="module")
def service(mlflow_server, tmp_path_factory):
    """v1 (@champion) indexed, v2 registered; `compat serve` following @champion."""
    from mlflow import MlflowClient

    folder = tmp_path_factory.mktemp("serve-api-docs")
    client = MlflowClient(mlflow_server.tracking_uri)
    v1, v2 = (helpers.register_random_model(client, NAME, seed, folder) for seed in (0, 1))
    client.set_registered_model_alias(NAME, "champion", v1)
    config = helpers.write_config(folder)
    root = str(folder / "index")
    assert main(["index", "build", root, "--config", str(config), "--model", f"models:/{NAME}@champion",
                 "--tracking-uri", mlflow_server.tracking_uri]) == 0
    home = folder / "home"
    home.mkdir()
    env = user_env(home, MLFLOW_TRACKING_URI=mlflow_server.tracking_uri, XDG_CACHE_HOME=str(folder / "cache"))
    port, log = free_port(), folder / "serve.log"
    with log.open("w") as handle:
        process = subprocess.Popen([PYTHON, "-m", "app.cli", "serve", root, "--model", f"models:/{NAME}@champion",
                                    "--port", str(port), "--num-cpus", "0", "--poll-s", "0.3"], env=env,
                                   stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_version(url, process, log, v1)
        deadline = time.monotonic() + 60   # the command's ready line, printed once the first load is seen
        while f"API reference {url}/docs" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert f"API reference {url}/docs" in log.read_text(), log.read_text()[-3000:]
        yield {"url": url, "client": client, "v1": v1, "v2": v2, "process": process, "log": log}
    finally:
        process.terminate()
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_version(url: str, process: subprocess.Popen, log, version: str, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"compat serve exited {process.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"version {version} not served after {timeout_s} s:\n" \
                                            f"{log.read_text()[-3000:]}"
        try:
            status, health = helpers.call(url, "/healthz", timeout=10)
        except OSError:
            status, health = None, None
        if status == 200 and health.get("model_version") == version:
            return health
        time.sleep(0.3)


def _document(service) -> dict:
    status, document = helpers.call(service["url"], "/openapi.json")
    assert status == 200 and document["openapi"].startswith("3."), document
    return document


def _check_object(document: dict, name: str, answer: dict) -> None:
    """The answer's fields are the schema's: every always-present field there, nothing the schema does not list."""
    schema = document["components"]["schemas"][name]
    assert set(schema["required"]) <= set(answer), (name, sorted(answer))
    assert set(answer) <= set(schema["properties"]), (name, sorted(set(answer) - set(schema["properties"])))
    for field in schema["properties"].values():
        assert "Unit: " in field["description"], (name, field)
    for key, value in answer.items():
        declared = schema["properties"][key]["type"]
        declared = set(declared if isinstance(declared, list) else [declared])
        declared |= {"integer"} if "number" in declared else set()   # JSON Schema: an integer is a number
        assert _json_type(value) in declared, (name, key, value)


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def test_request_schema_is_exactly_what_the_parser_accepts(service):
    document = _document(service)
    request = document["components"]["schemas"]["SearchRequest"]
    assert set(request["properties"]) == set(FIELDS)
    assert request["additionalProperties"] is False
    health = helpers.call(service["url"], "/healthz")[1]
    assert request["properties"]["embedding"]["minItems"] == health["dim"] == 9
    # the service reads every field the schema lists (a wrong type is refused naming it, not as an unknown field)
    wrong = {"embedding": "x", "image": 12, "k": "5", "model_version": [1], "include_payload": "yes"}
    assert set(wrong) == set(request["properties"])
    for field, value in wrong.items():
        body = {"embedding": [0.1] * 9, field: value} if field != "image" else {"image": value}
        status, answer = helpers.call(service["url"], "/search", body)
        assert status == 400 and answer["error"]["field"] == field, (field, answer)
        assert "unknown field" not in answer["error"]["message"]
    status, answer = helpers.call(service["url"], "/search", {"embedding": [0.1] * 9, "top_k": 3})
    assert status == 400 and answer["error"]["field"] == "top_k" and "unknown field" in answer["error"]["message"]
    _check_object(document, "Error", answer)
    assert set(document["paths"]) == set(ROUTES)
    for path, method in ROUTES.items():
        assert set(document["paths"][path]) == {method.lower()}


def test_every_example_is_answered_with_200_and_the_answers_match_the_schema(service):
    document = _document(service)
    examples = document["paths"]["/search"]["post"]["requestBody"]["content"]["application/json"]["examples"]
    assert set(examples) == {"embedding", "image"}
    for name, example in examples.items():
        status, answer = helpers.call(service["url"], "/search", example["value"])
        assert status == 200, (name, answer)
        assert answer["model_version"] == service["v1"] and len(answer["results"]) == example["value"]["k"]
        _check_object(document, "SearchResponse", answer)
        for result in answer["results"]:
            _check_object(document, "SearchResult", result)
        if name == "embedding":   # a gallery row of the serving version: itself is the top item
            assert answer["results"][0]["score"] == pytest.approx(1.0, abs=1e-5)
        else:
            assert all("payload_uri" in result for result in answer["results"])
    status, health = helpers.call(service["url"], "/healthz")
    assert status == 200
    _check_object(document, "Health", health)


def test_docs_page_is_self_contained_and_names_every_field(service):
    import html

    status, page = helpers.call(service["url"], "/docs")
    assert status == 200 and page.startswith("<!doctype html>")
    assert not re.search(r"""(src|href)\s*=\s*['"]?(https?:)?//""", page, re.IGNORECASE), "an asset from elsewhere"
    assert "<script" not in page.lower()
    document = _document(service)
    for name, schema in document["components"]["schemas"].items():
        assert f"<h3 id='{name}'>" in page
        for field in schema["properties"]:
            assert f"<code>{field}</code>" in page, (name, field)
    for path in ROUTES:
        assert f"<code>{path}</code>" in page
    assert html.escape(MODEL_VERSION_RULES) in page


def test_the_stated_model_version_rules_are_what_the_service_does(service):
    """After the alias moves to v2 (the index holds only v1's items): v2 is searched, v1 is 409, an unknown
    version 400, an image with a model_version 400; without model_version any embedding is searched."""
    client = service["client"]
    client.set_registered_model_alias(NAME, "champion", service["v2"])
    try:
        _wait_version(service["url"], service["process"], service["log"], service["v2"])
        document = _document(service)
        assert service["v2"] in document["info"]["description"]
        example = document["paths"]["/search"]["post"]["requestBody"]["content"]["application/json"]["examples"]
        query = example["embedding"]["value"]
        assert query["model_version"] == service["v2"]
        cases = [({**query}, 200, None), ({**query, "model_version": service["v1"]}, 409, "model_version"),
                 ({**query, "model_version": "999"}, 400, "model_version"),
                 ({k: v for k, v in query.items() if k != "model_version"}, 200, None),
                 ({**example["image"]["value"], "model_version": service["v2"]}, 400, "model_version")]
        for body, expected, field in cases:
            status, answer = helpers.call(service["url"], "/search", body)
            assert status == expected, (body.get("model_version"), answer)
            if field is not None:
                assert answer["error"]["field"] == field
                _check_object(document, "Error", answer)
            else:
                assert answer["model_version"] == service["v2"]
    finally:
        client.set_registered_model_alias(NAME, "champion", service["v1"])
