"""A recalibrated version of the served weights is served without a restart (ibedl.engine.versions,
ibedl.engine.runtime.recalibrated): the next answers carry its version and thresholds, the drift monitor follows its
reference, the model info gauge its version; a manifest that changes the weights or names another adapter is left
for a restart, and the service keeps serving what it loaded."""

from __future__ import annotations

import shutil

import pytest

from ibedl.core.artifact import read_manifest, write_manifest
from tests.http_json import ok_json

Q = {"question": "Which is sun?", "options": ["sun", "moon", "tree", "bird"]}


@pytest.fixture
def served(tiny_artifact, tmp_path):
    art = tmp_path / "served"
    shutil.copytree(tiny_artifact, art)
    return art


def recalibrate(directory, **abstention) -> str:
    """Write the next version of ``directory``'s manifest with other thresholds at every level, as an in-place
    recalibration does (same weights); its version."""
    m = read_manifest(directory)
    m.version = str(int(m.version) + 1)
    m.abstention.update(abstention)
    for entry in m.abstention.get("by_options", {}).values():
        entry.update({k: v for k, v in abstention.items() if k in ("min_confidence", "ood_threshold")})
    write_manifest(directory, m)
    return m.version


def test_a_recalibrated_version_is_served_from_the_next_request(make_client, served):
    with make_client(artifact=served, reload_interval_s=0) as c:
        state = c.app.state.service
        before = ok_json(c.post("/predict", json=Q))
        assert c.portal.call(state.engine.versions.reload_calibrations) == []  # nothing new: nothing reloaded
        version = recalibrate(served, min_confidence=1.0, ood_threshold=0.0)
        assert c.portal.call(state.engine.versions.reload_calibrations) == ["tiny"]
        after = ok_json(c.post("/predict", json=Q))
        card = ok_json(c.get("/v1/models"))["data"][0]
        metrics = c.get("/metrics").text
    assert before["adapter"]["version"] != version == after["adapter"]["version"] == card["version"]
    assert after["abstain_reason"] == "min_confidence"  # its own threshold answers nothing below certainty
    assert f'version="{version}"' in next(line for line in metrics.splitlines()
                                           if line.startswith("ibedl_model_info{"))


def test_the_watcher_finds_a_changed_manifest_by_itself(make_client, served):
    import time

    with make_client(artifact=served, reload_interval_s=0.05) as c:
        version = recalibrate(served, min_confidence=1.0, ood_threshold=0.0)
        deadline = time.monotonic() + 30
        while ok_json(c.get("/v1/models"))["data"][0]["version"] != version:
            assert time.monotonic() < deadline, "the watcher never served the new version"


@pytest.mark.parametrize("change, why", [
    ("weights", "changes its weight files: not a recalibration of the served weights; restart the service"),
    ("name", "the manifest names adapter 'other', not the served 'tiny'"),
])
def test_a_manifest_that_is_not_a_recalibration_is_left_for_a_restart(make_client, served, caplog, change, why):
    with make_client(artifact=served, reload_interval_s=0) as c:
        state = c.app.state.service
        loaded = ok_json(c.get("/v1/models"))["data"][0]["version"]
        m = read_manifest(served)
        m.version = str(int(m.version) + 1)
        if change == "weights":
            m.files = {name: "0" * 64 for name in m.files}
        else:
            m.name = "other"
        write_manifest(served, m)
        with caplog.at_level("WARNING", logger="ibedl.engine"):
            assert c.portal.call(state.engine.versions.reload_calibrations) == []
        if change == "weights":
            assert why in caplog.text
        else:  # another adapter's manifest: no served runtime of that name, nothing to reload
            assert "other" not in ok_json(c.get("/v1/models"))["data"][0]["id"]
        answer = ok_json(c.post("/predict", json=Q))
    assert answer["adapter"]["version"] == loaded and answer["adapter"]["name"] == "tiny"


def test_recalibrated_refuses_other_weights_directly(tiny_artifact):
    """The runtime-level check: only the calibration sections may change."""
    from ibedl.core.predictor import Predictor
    from ibedl.engine.runtime import make_runtimes, recalibrated
    from ibedl.engine.settings import EngineSettings

    settings = EngineSettings(artifact=tiny_artifact, max_tokens=96)
    runtime = make_runtimes([Predictor.from_artifact(tiny_artifact)], settings)["tiny"]
    m = read_manifest(tiny_artifact)
    m.version, m.prompt = "99", {**m.prompt, "template": "{question} {options} Answer:"}
    with pytest.raises(ValueError, match="changes its prompt: not a recalibration"):
        recalibrated(runtime, m, settings)
    m = read_manifest(tiny_artifact)
    m.version = "99"
    new = recalibrated(runtime, m, settings)
    assert new.ref["version"] == "99" and runtime.ref["version"] != "99"  # the old runtime stays whole
    assert new.predictor.manifest is m and runtime.predictor.manifest is not m


def test_with_several_adapters_only_the_recalibrated_one_moves(make_client, served, tiny_map_artifact, tmp_path):
    other = tmp_path / "map"
    shutil.copytree(tiny_map_artifact, other)
    with make_client(artifacts=f"{served},{other}", reload_interval_s=0) as c:
        state = c.app.state.service
        before = {card["id"]: card["version"] for card in ok_json(c.get("/v1/models"))["data"]}
        version = recalibrate(other, min_confidence=1.0)
        assert c.portal.call(state.engine.versions.reload_calibrations) == ["tiny-map"]
        after = {card["id"]: card["version"] for card in ok_json(c.get("/v1/models"))["data"]}
        answer = ok_json(c.post("/predict", json={**Q, "adapter": "tiny-map"}))
    assert after == {**before, "tiny-map": version} and answer["adapter"]["version"] == version


def test_the_new_version_is_built_on_the_model_thread(make_client, served, monkeypatch):
    """Building the new runtime copies the heads (torch work): on the engine's model thread, never the event loop's
    (one OpenMP team, ibedl.engine.engine.Engine)."""
    import threading

    import ibedl.engine.versions as versions

    built_on: list[str] = []

    def recording(*args):
        built_on.append(threading.current_thread().name)
        return versions_recalibrated(*args)

    versions_recalibrated = versions.recalibrated
    monkeypatch.setattr(versions, "recalibrated", recording)
    with make_client(artifact=served, reload_interval_s=0) as c:
        recalibrate(served, min_confidence=1.0, ood_threshold=0.0)
        assert c.portal.call(c.app.state.service.engine.versions.reload_calibrations) == ["tiny"]
    assert len(built_on) == 1 and built_on[0].startswith("ibedl-model"), built_on
