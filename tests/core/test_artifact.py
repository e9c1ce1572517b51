"""ibedl.core.artifact versions and weight hashes, and python -m ibedl.core.migrate on real committed artifacts."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import pytest

from ibedl.core import migrate as migrate_cli
from ibedl.core.artifact import (
    MIGRATIONS,
    SCHEMA_VERSION,
    ArtifactError,
    Manifest,
    check_artifact,
    migrate,
    read_manifest,
    write_manifest,
)
from ibedl.core.model_card import render_card

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = [ROOT / "artifacts" / name for name in ("default", "map", "map-twin")]
CACHE_PATH = "/root/.cache/ibedl/models/smollm2-135m-instruct-b179c9523d0e"  # what version 1 artifacts carried


def committed(name: str = "default") -> dict:
    return json.loads((ROOT / "artifacts" / name / "manifest.json").read_text())


def as_version_1(data: dict, ref: str | None = None) -> dict:
    """The same adapter's manifest as schema version 1 wrote it: ``"extra": {}`` in head, no ``files`` nor
    ``limitations``, and (``ref``) base_model.ref as a run given the conversion-cache directory recorded it."""
    v1 = copy.deepcopy(data)
    v1["schema_version"] = 1
    v1["head"]["extra"] = {}
    del v1["files"], v1["limitations"], v1["calibrated_on"], v1["backend_calibrations"]
    if ref is not None:
        v1["base_model"]["ref"] = ref
    return v1


class TestVersions:
    def test_the_committed_manifests_are_the_current_version(self):
        assert SCHEMA_VERSION == 3 and sorted(MIGRATIONS) == list(range(1, SCHEMA_VERSION))
        for directory in COMMITTED:
            assert json.loads((directory / "manifest.json").read_text())["schema_version"] == SCHEMA_VERSION

    def test_version_1_is_migrated_when_read(self, tmp_path, caplog):
        v2 = committed()
        (tmp_path / "manifest.json").write_text(json.dumps(as_version_1(v2, ref=CACHE_PATH)))
        with caplog.at_level(logging.WARNING, logger="ibedl.core.artifact"):
            manifest = read_manifest(tmp_path)
        assert f"python -m ibedl.core.migrate {tmp_path}" in caplog.text
        assert "schema_version 1, read as 3" in caplog.text
        assert manifest.schema_version == SCHEMA_VERSION
        assert "extra" not in manifest.head and manifest.head == v2["head"]
        assert manifest.base_model == v2["base_model"]  # the cache path became the known name
        assert manifest.base_model_ref().ref == "smollm2-135m-instruct"
        assert manifest.files == {} and manifest.limitations == [] and manifest.backend_calibrations == {}
        assert manifest.calibrated_on == "torch-fp32"  # trained and calibrated on the CPU
        new = ("files", "limitations", "backend_calibrations")
        assert {k: v for k, v in manifest.to_dict().items() if k not in new} == \
            {k: v for k, v in v2.items() if k not in new}

    def test_version_1_without_ref_gets_the_name(self):
        v1 = as_version_1(committed("map"))
        del v1["base_model"]["ref"]
        assert Manifest.from_dict(v1).base_model_ref().ref == "smollm2-135m-instruct"

    def test_migration_leaves_its_input_alone(self):
        v1 = as_version_1(committed(), ref=CACHE_PATH)
        before = copy.deepcopy(v1)
        migrate(v1)
        assert v1 == before

    def test_a_newer_version_asks_for_a_newer_ibedl(self):
        with pytest.raises(ArtifactError, match=r"schema_version 4 is newer than this ibedl reads \(3\): upgrade "
                                                r"ibedl \(pip install -U ibedl\)"):
            Manifest.from_dict({**committed(), "schema_version": 4})

    @pytest.mark.parametrize("version", [None, 0, "2", True, 1.0])
    def test_an_unknown_version_names_it_and_what_is_read(self, version):
        data = {k: v for k, v in committed().items() if k != "schema_version"}
        if version is not None:
            data["schema_version"] = version
        with pytest.raises(ArtifactError, match=rf"schema_version is {version!r}; this ibedl reads versions 1 to 3 "
                                                r".*python -m ibedl.core.migrate DIR"):
            Manifest.from_dict(data)

    def test_constructing_another_version_directly_is_refused(self):
        with pytest.raises(ArtifactError, match="schema_version 1 is not 3"):
            Manifest(**{**committed(), "schema_version": 1})


class TestCalibrationsPerBackend:
    def test_version_2_names_the_arithmetic_its_calibration_was_made_on(self):
        v2 = {k: v for k, v in committed().items() if k not in ("calibrated_on", "backend_calibrations")}
        v2["schema_version"] = 2
        assert Manifest.from_dict(v2).calibrated_on == "torch-fp32"  # trained (and calibrated) on the CPU
        on_cuda = copy.deepcopy(v2)
        on_cuda["training"]["device"] = "cuda:0"
        assert Manifest.from_dict(on_cuda).calibrated_on == "torch-cuda-bf16"  # bfloat16 unless a dtype was set
        on_cuda["training"]["config"].update(dtype="float32", load_in_4bit=True)
        assert Manifest.from_dict(on_cuda).calibrated_on == "torch-cuda-nf4-fp32"

    def test_the_top_level_calibration_is_the_one_calibrated_on(self):
        manifest = Manifest.from_dict(committed("map"))
        served = manifest.calibration_for(manifest.calibrated_on)
        assert served.key == manifest.calibrated_on and served.record == manifest.calibration
        assert served.thresholds == manifest.thresholds() and served.conformal == manifest.conformal_sets()
        assert served.head == {"temperature": manifest.head_config().temperature}
        assert manifest.calibration_for("openvino-bf16") is None

    def test_a_backend_calibration_is_stored_beside_and_read_back(self, tmp_path):
        manifest = Manifest.from_dict(committed("map"))
        top = copy.deepcopy(manifest.to_dict())
        sections = {"abstention": {**manifest.abstention, "min_confidence": 0.7}, "conformal": manifest.conformal,
                    "calibration": {"n": 3}, "reference": {"confidence": [0.5, 0.6]}}
        manifest.set_calibration("openvino-bf16", {"temperature": 1.5}, sections, {"test": {"accuracy": 0.5}})
        write_manifest(tmp_path, manifest)
        again = read_manifest(tmp_path)
        assert again.calibration_keys() == ["torch-fp32", "openvino-bf16"]
        served = again.calibration_for("openvino-bf16")
        assert served.head == {"temperature": 1.5} and served.thresholds.min_confidence == 0.7
        assert served.record == {"n": 3} and served.metrics == {"test": {"accuracy": 0.5}}
        assert {k: v for k, v in again.to_dict().items() if k != "backend_calibrations"} == \
            {k: v for k, v in top.items() if k != "backend_calibrations"}  # the top-level one is untouched

    @pytest.mark.parametrize(("entry", "complaint"), [
        ({"head": {"zeta_scale": 1.0}}, "sets only"),
        ({"abstention": {"min_confidence": 2.0}}, "min_confidence must be in"),
        ({"surprise": 1}, "unexpected keyword argument 'surprise'"),
    ])
    def test_a_bad_backend_calibration_is_refused_by_name(self, entry, complaint):
        data = {**committed("map"), "backend_calibrations": {"openvino-fp32": entry}}
        with pytest.raises(ArtifactError, match=rf"backend_calibrations.openvino-fp32.*{complaint}"):
            Manifest.from_dict(data)

    def test_the_top_level_key_cannot_be_repeated(self):
        with pytest.raises(ArtifactError, match="without calibrated_on"):
            Manifest.from_dict({**committed("map"), "backend_calibrations": {"torch-fp32": {}}})


class TestFiles:
    def test_weights_are_checked_against_the_recorded_sha256(self, tmp_path):
        copy_dir = tmp_path / "default"
        shutil.copytree(ROOT / "artifacts" / "default", copy_dir)
        manifest = check_artifact(copy_dir, verify=True)
        assert sorted(manifest.files) == ["adapter_model.safetensors", "head.safetensors"]
        head = copy_dir / "head.safetensors"
        head.write_bytes(head.read_bytes()[:-1] + bytes([head.read_bytes()[-1] ^ 1]))
        check_artifact(copy_dir)  # loading alone does not hash
        with pytest.raises(ArtifactError, match=r"weight files \['head.safetensors'\] differ from the sha256"):
            check_artifact(copy_dir, verify=True)

    def test_a_manifest_without_checksums_is_refused_with_the_migrate_command(self, tmp_path):
        copy_dir = tmp_path / "default"
        shutil.copytree(ROOT / "artifacts" / "default", copy_dir)
        data = committed()
        data["files"] = {}
        (copy_dir / "manifest.json").write_text(json.dumps(data))
        check_artifact(copy_dir)  # readable (migrate reads it this way) ...
        with pytest.raises(ArtifactError) as e:  # ... but not loadable
            check_artifact(copy_dir, verify=True)
        assert "records no sha256 of the weight files" in str(e.value)
        assert f"python -m ibedl.core.migrate {copy_dir}" in str(e.value)
        assert migrate_cli.main([str(copy_dir)]) == 0  # the command it names records them ...
        assert check_artifact(copy_dir, verify=True).files == committed()["files"]  # ... as committed

    def test_a_version_1_manifest_is_refused_until_migrated(self, tmp_path):
        copy_dir = tmp_path / "default"
        shutil.copytree(ROOT / "artifacts" / "default", copy_dir)
        (copy_dir / "manifest.json").write_text(json.dumps(as_version_1(committed())))  # no `files` key at all
        with pytest.raises(ArtifactError, match="python -m ibedl.core.migrate"):
            check_artifact(copy_dir, verify=True)

    @pytest.mark.parametrize("name", ["default", "map", "map-twin"])
    def test_the_committed_artifacts_record_every_weight_file(self, name):
        manifest = check_artifact(ROOT / "artifacts" / name, verify=True)
        assert sorted(manifest.files) == ["adapter_model.safetensors", "head.safetensors"]


class TestMembers:
    @pytest.mark.parametrize("member", ["../elsewhere", "members/../../x", "..", "/etc", "/tmp/adapter",
                                        "C:\\adapter", "members\\0", "", 3])
    def test_a_member_outside_the_artifact_is_refused(self, member):
        data = committed()
        data["members"] = [member]
        with pytest.raises(ArtifactError, match="member"):
            Manifest.from_dict(data)

    @pytest.mark.parametrize("members", [["."], ["members/0", "members/1"], ["./members/0"]])
    def test_relative_members_inside_it_are_read(self, members):
        data = committed()
        data["members"] = members
        assert Manifest.from_dict(data).members == members

    def test_a_member_that_is_a_symlink_out_of_the_artifact_is_refused(self, tmp_path):
        outside = tmp_path / "outside"
        shutil.copytree(ROOT / "artifacts" / "default", outside)
        art = tmp_path / "artifact"
        art.mkdir()
        data = committed()
        data["members"] = ["members/0"]
        data["files"] = {f"members/0/{n}": h for n, h in committed()["files"].items()}
        (art / "manifest.json").write_text(json.dumps(data))
        (art / "members").mkdir()
        (art / "members" / "0").symlink_to(outside, target_is_directory=True)
        with pytest.raises(ArtifactError, match="outside the artifact directory"):
            check_artifact(art)

    def test_a_weight_file_that_is_a_symlink_out_of_the_artifact_is_refused(self, tmp_path):
        art = tmp_path / "artifact"
        shutil.copytree(ROOT / "artifacts" / "default", art)
        (tmp_path / "head.safetensors").write_bytes((art / "head.safetensors").read_bytes())
        (art / "head.safetensors").unlink()
        (art / "head.safetensors").symlink_to(tmp_path / "head.safetensors")
        with pytest.raises(ArtifactError, match="head.safetensors leads to .* outside the artifact directory"):
            check_artifact(art, verify=True)

    def test_a_symlink_inside_the_artifact_is_fine(self, tmp_path):
        art = tmp_path / "artifact"
        shutil.copytree(ROOT / "artifacts" / "default", art)
        (art / "store").mkdir()
        (art / "head.safetensors").rename(art / "store" / "head.safetensors")
        (art / "head.safetensors").symlink_to(art / "store" / "head.safetensors")
        assert check_artifact(art, verify=True).files == committed()["files"]


def downgrade(directory: Path) -> None:
    """Turn a committed artifact copy back into what schema version 1 training wrote: its manifest, the
    adapter_config.json naming the training machine's cache path without a task type, no model card."""
    (directory / "manifest.json").write_text(json.dumps(as_version_1(committed(directory.name)), indent=2) + "\n")
    config = json.loads((directory / "adapter_config.json").read_text())
    config.update(base_model_name_or_path=CACHE_PATH, task_type=None)
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    (directory / "README.md").unlink()


class TestMigrateCommand:
    def test_committed_artifacts_are_in_the_current_format(self, capsys):
        """What CI checks: manifests, adapter configs and model cards are what the migration writes."""
        assert migrate_cli.main([*map(str, COMMITTED), "--check"]) == 0, capsys.readouterr().err
        for directory in COMMITTED:
            config = json.loads((directory / "adapter_config.json").read_text())
            assert config["base_model_name_or_path"] == "smollm2-135m-instruct" and config["task_type"] == "CAUSAL_LM"
            assert (directory / "README.md").read_text() == render_card(read_manifest(directory))

    @pytest.mark.parametrize("name", ["default", "map"])
    def test_a_version_1_artifact_becomes_the_committed_one_without_touching_weights(self, name, tmp_path, capsys):
        source, target = ROOT / "artifacts" / name, tmp_path / name
        shutil.copytree(source, target)
        downgrade(target)
        weights = {p.name: p.read_bytes() for p in target.glob("*.safetensors")}
        assert migrate_cli.main([str(target), "--check"]) == 1
        capsys.readouterr()
        assert migrate_cli.main([str(target)]) == 0
        report = json.loads(capsys.readouterr().out)[0]["changes"]
        assert report[0] == "manifest.json: schema_version 1 -> 3; sha256 of 2 weight files recorded"
        assert f"adapter_config.json: base_model_name_or_path {CACHE_PATH!r} -> 'smollm2-135m-instruct'" in report
        assert {p.name: p.read_bytes() for p in target.glob("*.safetensors")} == weights
        assert (target / "adapter_config.json").read_bytes() == (source / "adapter_config.json").read_bytes()
        migrated, expected = json.loads((target / "manifest.json").read_text()), committed(name)
        assert migrated["limitations"] == [] and migrated["backend_calibrations"] == {}
        assert migrated == {**expected, "limitations": [], "backend_calibrations": {}}
        assert (target / "README.md").read_text() == render_card(read_manifest(target))
        assert migrate_cli.main([str(target)]) == 0 and json.loads(capsys.readouterr().out)[0]["changes"] == []

    def test_changed_weights_are_refused(self, tmp_path, capsys):
        target = tmp_path / "map"
        shutil.copytree(ROOT / "artifacts" / "map", target)
        (target / "adapter_model.safetensors").write_bytes(b"not the trained weights")
        assert migrate_cli.main([str(target)]) == 2
        assert "['adapter_model.safetensors'] differ from the sha256" in capsys.readouterr().err

    def test_another_task_type_is_refused(self, tmp_path, capsys):
        target = tmp_path / "map"
        shutil.copytree(ROOT / "artifacts" / "map", target)
        config = json.loads((target / "adapter_config.json").read_text())
        (target / "adapter_config.json").write_text(json.dumps({**config, "task_type": "SEQ_CLS"}))
        assert migrate_cli.main([str(target)]) == 2
        assert "task_type 'SEQ_CLS'" in capsys.readouterr().err


def test_plain_peft_loads_a_trained_adapter_by_its_config(tiny_artifact):
    """adapter_config.json names the base by the manifest's portable ref with task_type CAUSAL_LM, and a plain
    PeftModel.from_pretrained on that base restores exactly the saved LoRA tensors."""
    import torch
    from peft import PeftModel, PeftModelForCausalLM, get_peft_model_state_dict
    from safetensors.torch import load_file

    from ibedl.core.base_model import load_base_model, resolve_model

    config = json.loads((tiny_artifact / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == read_manifest(tiny_artifact).base_model_ref().ref
    model, _ = load_base_model(resolve_model(config["base_model_name_or_path"]), device="cpu")
    peft_model = PeftModel.from_pretrained(model, tiny_artifact)
    assert isinstance(peft_model, PeftModelForCausalLM)
    saved, state = load_file(tiny_artifact / "adapter_model.safetensors"), get_peft_model_state_dict(peft_model)
    assert set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in saved)


def test_an_atomic_write_is_readable_by_all_or_keeps_the_mode_it_had(tmp_path):
    """A manifest written through mkstemp was 0600: the image's non-root user could not read a mounted artifact."""
    import os

    from ibedl.core.artifact import atomic_write_text

    old = os.umask(0o022)  # the test's own process: no other thread writes files here
    try:
        atomic_write_text(tmp_path / "manifest.json", "{}\n")
        os.umask(0o077)
        atomic_write_text(tmp_path / "private.json", "{}\n")
    finally:
        os.umask(old)
    assert (tmp_path / "manifest.json").stat().st_mode & 0o777 == 0o644  # as open() would make it
    assert (tmp_path / "private.json").stat().st_mode & 0o777 == 0o600  # under umask 077, as the weights would be
    (tmp_path / "manifest.json").chmod(0o640)  # its owner's choice stays
    atomic_write_text(tmp_path / "manifest.json", "{}\n")
    assert (tmp_path / "manifest.json").stat().st_mode & 0o777 == 0o640
