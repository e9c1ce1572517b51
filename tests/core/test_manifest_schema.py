"""The published JSON Schema of manifest.json: generated from the code, committed, and every real manifest fits it."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest

from ibedl.core.artifact import Manifest
from ibedl.core.head import HeadConfig
from ibedl.core.manifest_schema import main, manifest_schema, render

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "docs" / "reference" / "manifest.schema.json"
COMMITTED = [ROOT / "artifacts" / name for name in ("default", "map", "map-twin")]


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(PUBLISHED.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def errors(validator, data) -> list[str]:
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(data)]


def test_the_published_schema_is_the_one_the_code_defines():
    assert PUBLISHED.read_text() == render(), f"regenerate: python -m ibedl.core.manifest_schema --output {PUBLISHED}"
    assert main(["--check", str(PUBLISHED)]) == 0


def test_check_fails_on_a_stale_copy(tmp_path, capsys):
    stale = tmp_path / "manifest.schema.json"
    schema = manifest_schema()
    del schema["properties"]["limitations"]
    stale.write_text(json.dumps(schema, indent=2) + "\n")
    assert main(["--check", str(stale)]) == 1
    assert f"python -m ibedl.core.manifest_schema --output {stale}" in capsys.readouterr().err
    assert main(["--check", str(tmp_path / "absent.json")]) == 1
    assert f"{tmp_path / 'absent.json'} does not exist; regenerate it" in capsys.readouterr().err


def test_output_that_cannot_be_written_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["--output", str(tmp_path / "file" / "s.json")]) == 2  # was FileNotFoundError's traceback
    assert capsys.readouterr().err.startswith(f"error: --output {tmp_path / 'file' / 's.json'}: ")
    assert main(["--output", str(tmp_path / "new" / "s.json")]) == 0
    assert json.loads((tmp_path / "new" / "s.json").read_text()) == manifest_schema()


def test_every_field_is_in_the_schema_and_only_defaults_are_optional():
    schema = manifest_schema()
    assert list(schema["properties"]) == [f.name for f in dataclasses.fields(Manifest)]
    assert schema["required"] == ["method", "base_model", "head", "option_token_ids", "prompt"]
    assert list(schema["properties"]["head"]["properties"]) == [f.name for f in dataclasses.fields(HeadConfig)]
    assert schema["properties"]["schema_version"]["const"] == 3
    assert schema["properties"]["head"]["properties"]["kind"]["enum"] == ["softmax", "evidential", "ib_edl"]


@pytest.mark.parametrize("directory", COMMITTED, ids=lambda p: p.name)
def test_every_committed_manifest_validates(validator, directory):
    data = json.loads((directory / "manifest.json").read_text())
    assert errors(validator, data) == []


def test_a_freshly_trained_manifest_validates(validator, tiny_artifact):
    assert errors(validator, json.loads((tiny_artifact / "manifest.json").read_text())) == []


@pytest.mark.parametrize(("change", "complaint"), [
    (lambda d: d.update(schema_version=1), "schema_version: 3 was expected"),
    (lambda d: d["head"].update(extra={}), "head: Additional properties are not allowed ('extra' was unexpected)"),
    (lambda d: d.update(surprise=1), "Additional properties are not allowed ('surprise' was unexpected)"),
    (lambda d: d["base_model"].pop("ref"), "base_model: 'ref' is a required property"),
    (lambda d: d["abstention"].update(ood_score="entropy"), "abstention/ood_score: 'entropy' is not valid"),
    (lambda d: d.update(mc_samples="0"), "mc_samples: '0' is not of type 'integer'"),
    (lambda d: d["files"].update({"head.safetensors": 1}), "files/head.safetensors: 1 is not of type 'string'"),
])
def test_the_schema_refuses_what_the_loader_refuses(validator, change, complaint):
    data = copy.deepcopy(json.loads((COMMITTED[0] / "manifest.json").read_text()))
    change(data)
    found = errors(validator, data)
    assert any(complaint in e for e in found), found
