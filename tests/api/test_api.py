"""The Python API (``ibedl.load(...).predict``) answers exactly as the HTTP service does, without FastAPI; the
batch command scores a JSONL file into the same records, with error records for bad lines."""

import json
import subprocess
import sys

import pytest

import ibedl
from ibedl.batch import main as batch_main
from ibedl.engine.errors import InvalidRequest, TooLarge, UnknownAdapter
from tests.http_json import ok_json

QUESTIONS = [
    {"question": "Which is sun?", "options": ["sun", "moon", "tree"], "id": "a"},
    {"question": "Which is water?", "options": {"A": "stone", "B": "water"}, "context": "Water flows.", "id": "b"},
    {"question": "Which is bird?", "options": ["fish", "bird", "cloud", "river"], "id": "c",
     "abstain": {"max_uncertainty": 0.1}},
]


@pytest.fixture(scope="module")
def model(tiny_artifact, tiny_map_artifact):
    return ibedl.load(tiny_artifact, tiny_map_artifact, max_tokens=96)


def test_api_answers_equal_the_http_responses(model, make_client, tiny_artifact, tiny_map_artifact):
    """The one-code-path evidence: the same questions through the app and through the API give equal records."""
    with make_client(artifacts=f"{tiny_artifact},{tiny_map_artifact}") as c:
        http = [ok_json(c.post("/predict", json={**q, "adapter": a})) for a in ("tiny", "tiny-map") for q in QUESTIONS]
        cards = ok_json(c.get("/v1/models"))["data"]
    api = [r.model_dump() for a in ("tiny", "tiny-map") for r in model.predict(QUESTIONS, adapter=a)]
    assert api == http
    assert api[2]["abstained"] and api[2]["abstain_reason"] == "max_uncertainty"
    assert [r["adapter"]["name"] for r in api] == ["tiny"] * 3 + ["tiny-map"] * 3
    assert [card["id"] for card in model.cards()] == [card["id"] for card in cards] == model.adapters


def test_api_takes_mcquestions_and_refuses_what_the_service_refuses(model):
    from ibedl.core.prompt import MCQuestion

    (answer,) = model.predict([MCQuestion("Which is sun?", ("sun", "moon", "tree"), id="m")])
    assert answer.id == "m" and answer.prediction.letter in "ABC"
    with pytest.raises(InvalidRequest) as e:
        model.predict([QUESTIONS[0], {"question": "q", "options": ["only one"]}])
    assert isinstance(e.value, ibedl.EngineError) and not hasattr(e.value, "status")  # no HTTP status in the API
    assert (e.value.type, e.value.field) == ("invalid_request", "items.1.options")
    assert "2..26 options" in e.value.message
    with pytest.raises(UnknownAdapter, match=r"no adapter 'nope' is served; choose one of \['tiny', 'tiny-map'\]") as e:
        model.predict([{**QUESTIONS[0], "adapter": "nope"}])
    assert (e.value.type, e.value.field) == ("invalid_request", "items.0.adapter")
    with pytest.raises(TooLarge) as e:
        model.predict([{"question": "q" * 5000, "options": ["a", "b"]}])
    assert (e.value.type, e.value.field) == ("too_large", "items.0.question")
    # a dict that is not a request body: the engine's InvalidRequest naming the field, never pydantic's error
    with pytest.raises(InvalidRequest) as e:
        model.predict([QUESTIONS[0], {"question": "q"}])
    assert (e.value.type, e.value.field) == ("invalid_request", "items.1.options")
    assert "Field required" in e.value.message
    with pytest.raises(InvalidRequest) as e:  # the path as the service names it, not pydantic's union member
        model.predict([QUESTIONS[0], {"question": "q", "options": {"A": "a", "B": 2}}])
    assert (e.value.field, e.value.message) == ("items.1.options.B", "Input should be a valid string")
    with pytest.raises(TypeError, match="questions must be a list of questions, got one dict: pass \\[question\\]"):
        model.predict(QUESTIONS[0])  # its keys were read as questions
    for size in (0, -1, 2.5):
        with pytest.raises(ValueError, match=f"batch_size must be an integer >= 1 or None .*, got {size}"):
            model.predict(QUESTIONS, batch_size=size)  # 0 was the default, silently
    with pytest.raises(InvalidRequest) as e:
        model.record_feedback([{"receipt": 7}])
    assert e.value.field is not None and e.value.field.startswith("items.0.")


def test_load_takes_engine_settings_only(tiny_artifact):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="api_token"):
        ibedl.load(tiny_artifact, api_token="secret")  # an HTTP setting: the engine has none


def test_importing_the_api_does_not_import_fastapi():
    code = "import sys, ibedl, ibedl.batch; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('fastapi', 'starlette', 'uvicorn', 'prometheus_client')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_batch_command_round_trip(model, tiny_artifact, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    lines = [json.dumps(QUESTIONS[0]), "{not json", "",
             json.dumps({"question": "Which is sun?", "options": ["sun", "x"]}),
             json.dumps({"question": "q", "options": ["a", "b"], "colour": "red"}), json.dumps(QUESTIONS[1])]
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    assert batch_main(["--artifact", str(tiny_artifact), "--input", str(src), "--output", str(out),
                       "--batch-size", "2", "--no-progress"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert not (tmp_path / "out.jsonl.partial").exists()
    assert len(records) == 5  # one per non-blank line, in order
    first, bad_json, no_id, extra, second = records
    expected = [r.model_dump() for r in model.predict([QUESTIONS[0], QUESTIONS[1]], adapter="tiny")]
    assert [first, second] == expected  # the service's records
    assert bad_json["line"] == 2 and bad_json["error"]["type"] == "invalid_json"
    assert no_id["id"] == "4" and no_id["adapter"]["name"] == "tiny"  # id: the line number
    assert extra["line"] == 5 and extra["error"]["field"] == "colour"
    assert "3 answered, 2 refused" in capsys.readouterr().err


def test_batch_command_keeps_going_past_a_line_that_is_not_utf8(tiny_artifact, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + json.dumps(QUESTIONS[0]).encode() + b"\n"  # a byte-order mark first
                    + b'{"question": "\xff", "options": ["a", "b"]}\n' + json.dumps(QUESTIONS[1]).encode() + b"\n")
    out = tmp_path / "out.jsonl"
    assert batch_main(["--artifact", str(tiny_artifact), "--input", str(src), "--output", str(out),
                       "--no-progress"]) == 0
    first, bad, third = [json.loads(line) for line in out.read_text().splitlines()]
    assert "prediction" in first and "prediction" in third
    assert bad["line"] == 2 and bad["error"]["type"] == "invalid_body" and "not UTF-8" in bad["error"]["message"]


def test_batch_command_help_and_bad_arguments(tmp_path):
    with pytest.raises(SystemExit) as e:
        batch_main(["--artifact", "x", "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o")])
    assert e.value.code == 2
