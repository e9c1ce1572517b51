"""IBEDL_BACKEND=auto in the service: ready at once on a backend that needs no build, then the others are built and
timed in the background and the service switches to one proven faster; requests keep being answered through the
switch, each under the calibration of the backend that computed it. Builds and timings are injected (no OpenVINO, no
dependence on this machine's speed); the real ones are recorded by benchmarks/backend_switch.py."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest

from ibedl.core import auto_backend
from ibedl.core.auto_backend import AutoChoice
from ibedl.core.backends import openvino_ir
from ibedl.engine import backend_switch
from ibedl.engine.backend_switch import BackendSwitcher, BuildFailed, build_in_child
from tests.serve.conftest import load_predictor
from tests.serve.test_backend_calibration import Q, recalibrated

LAST: list[str] = []  # the backend whose trunk ran last (the injected timer reads it)


class Trunk:
    """Stands for a compiled OpenVINO trunk: the torch decoder's hidden states, scaled (other arithmetic)."""

    def __init__(self, decoder, name: str) -> None:
        self.decoder, self.name = decoder, name

    def __call__(self, batch):
        LAST.append(self.name)
        out = self.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        return out.last_hidden_state[range(batch.input_ids.shape[0]), batch.last_index] * (1.0 + 1e-3)


@pytest.fixture
def bf16_calibrated(tiny_artifact, tmp_path, monkeypatch):
    """The tiny artifact calibrated on torch-fp32 and on openvino-bf16 (which abstains below confidence 0.25)."""
    monkeypatch.setenv("IBEDL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(openvino_ir, "native_bf16", lambda: True)
    return recalibrated(tiny_artifact, tmp_path / "bf16", "torch-fp32", {
        "openvino-bf16": {"sections": {"abstention": {"min_confidence": 0.25}, "calibration": {"marker": "bf16"}}}})


def unmeasured_loader(settings):
    """The predictor as ``auto`` loads it on a fresh machine: torch, with openvino-bf16 still to build and time."""
    predictor = load_predictor(settings.model_copy(update={"backend": "torch"}))
    predictor.backend_choice = AutoChoice("torch", "not measured on this machine yet", pending=["openvino-bf16"],
                                          base_sha256="base")
    predictor.backend_reason = predictor.backend_choice.reason
    return predictor


@pytest.fixture
def switching(monkeypatch):
    """``switching(seconds, fail=None, on_build=None, make=Trunk)``: the service's switcher builds ``make(decoder,
    name)`` (or raises ``fail``) once the returned gate is set, calling ``on_build(switcher, name)`` first, and times
    each backend at ``seconds[name]``."""

    def install(seconds: dict[str, float], fail: Exception | None = None, on_build=None,
                make=Trunk) -> threading.Event:
        gate = threading.Event()
        gate.built = {}  # name -> weak reference to the trunk built for it
        real_torch = auto_backend.torch_hidden

        def torch_hidden(predictor, batch):
            LAST.append("torch")
            return real_torch(predictor, batch)

        def build(switcher):
            decoder = switcher.shadow.decoder  # a fake trunk computes with torch's decoder, even once it is released

            def run(name):
                assert gate.wait(30)
                if on_build is not None:
                    on_build(switcher, name)
                if fail is not None:
                    raise fail
                trunk = make(decoder, name)
                gate.built[name] = weakref.ref(trunk)
                return trunk
            return run

        def timer(run):
            run()
            return seconds[LAST[-1]]

        class Injected(BackendSwitcher):
            def __init__(self, engine, adapter, names):
                super().__init__(engine, adapter, names, timer=timer, rounds=3)
                self._build = build(self)

        monkeypatch.setattr(auto_backend, "torch_hidden", torch_hidden)
        monkeypatch.setattr(backend_switch, "BackendSwitcher", Injected)
        return gate

    return install


def served(r) -> tuple[str, str]:
    return r.json()["adapter"]["backend"], r.json()["adapter"]["calibration"]


def test_ready_at_once_then_switched_when_proven_faster_without_failing_a_request(make_client, bf16_calibrated,
                                                                                    switching):
    gate = switching({"torch": 1.0, "openvino-bf16": 0.4})
    with make_client(loader=unmeasured_loader, artifact=bf16_calibrated) as c:
        state = c.app.state.service
        r = c.post("/predict", json=Q)  # ready while the candidate is not built yet
        assert r.status_code == 200 and served(r) == ("torch", "torch-fp32")
        card = c.get("/v1/models").json()["data"][0]
        assert card["backend"]["name"] == "torch" and card["backend"]["background"]["state"] == "building openvino-bf16"
        answers, stop = [], threading.Event()

        def traffic():
            while not stop.is_set():
                answers.append(c.post("/predict", json=Q))

        sender = threading.Thread(target=traffic)
        sender.start()
        gate.set()
        assert state.engine.versions.switcher.done.wait(30)
        stop.set()
        sender.join(30)
        after = c.post("/predict", json=Q)
        card = c.get("/v1/models").json()["data"][0]
        metrics = c.get("/metrics").text
    assert answers and all(a.status_code == 200 for a in answers)
    # every answer says the backend that computed it and the calibration made on that backend
    assert {served(a) for a in answers} <= {("torch", "torch-fp32"), ("openvino-bf16", "openvino-bf16")}
    assert served(after) == ("openvino-bf16", "openvino-bf16")
    assert card["backend"]["name"] == "openvino-bf16" and card["calibration_in_use"]["key"] == "openvino-bf16"
    assert card["abstention"]["min_confidence"] == 0.25 and card["calibration"]["marker"] == "bf16"
    background = card["backend"]["background"]
    assert background["state"] == "done" and background["switches"] == [{"from": "torch", "to": "openvino-bf16"}]
    assert background["seconds"] == {"torch": 1.0, "openvino-bf16": 0.4} and background["failed"] == {}
    assert card["backend"]["measured"]["seconds"] == {"torch": 1.0, "openvino-bf16": 0.4}
    assert 'ibedl_backend_switches_total{adapter="tiny",from="torch",to="openvino-bf16"} 1.0' in metrics
    assert state.engine.default.predictor.model is None  # the torch model is dropped once the trunk serves alone


def test_the_switched_runtime_is_built_on_the_model_thread(make_client, bf16_calibrated, switching, monkeypatch):
    """The new runtime's heads are copied (torch work) on the engine's model thread, not on the event loop's: one
    OpenMP team (ibedl.engine.engine.Engine)."""
    import ibedl.engine.versions as versions

    real, built_on = versions.switched, []

    def recording(*args):
        built_on.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(versions, "switched", recording)
    gate = switching({"torch": 1.0, "openvino-bf16": 0.4})
    with make_client(loader=unmeasured_loader, artifact=bf16_calibrated) as c:
        gate.set()
        assert c.app.state.service.engine.versions.switcher.done.wait(30)
        assert served(c.post("/predict", json=Q)) == ("openvino-bf16", "openvino-bf16")
    assert len(built_on) == 1 and built_on[0].startswith("ibedl-model"), built_on


def test_the_card_says_done_only_once_it_shows_the_measurement(make_client, bf16_calibrated, switching, monkeypatch):
    """A client that waits for ``background.state == "done"`` reads the timings in ``backend.measured``: the switcher
    announces it only after the measurement is recorded on the serving predictor (the recording is held here until
    the card has been read in between)."""
    import asyncio

    from ibedl.engine.versions import Versions

    recording, release = threading.Event(), threading.Event()
    settle = Versions.settle_backend

    async def held(self, adapter, choice):
        recording.set()
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
        await settle(self, adapter, choice)

    monkeypatch.setattr(Versions, "settle_backend", held)
    switching({"torch": 1.0, "openvino-bf16": 0.4}).set()
    with make_client(loader=unmeasured_loader, artifact=bf16_calibrated) as c:
        assert recording.wait(30)
        before = c.get("/v1/models").json()["data"][0]["backend"]
        release.set()
        assert c.app.state.service.engine.versions.switcher.done.wait(30)
        after = c.get("/v1/models").json()["data"][0]["backend"]
    assert before["background"]["state"] != "done" and before["measured"]["seconds"] == {}
    assert after["background"]["state"] == "done"
    assert after["measured"]["seconds"] == {"torch": 1.0, "openvino-bf16": 0.4}


def test_a_slower_candidate_is_measured_and_not_switched_to(make_client, bf16_calibrated, switching):
    gate = switching({"torch": 1.0, "openvino-bf16": 1.5})
    gate.set()
    with make_client(loader=unmeasured_loader, artifact=bf16_calibrated) as c:
        assert c.app.state.service.engine.versions.switcher.done.wait(30)
        r = c.post("/predict", json=Q)
        card = c.get("/v1/models").json()["data"][0]
        metrics = c.get("/metrics").text
    assert served(r) == ("torch", "torch-fp32") and card["backend"]["background"]["switches"] == []
    assert "ibedl_backend_switches_total{" not in metrics


def test_a_build_that_fails_leaves_the_service_where_it_was_with_the_reason(make_client, bf16_calibrated,
                                                                            switching, caplog):
    gate = switching({"torch": 1.0, "openvino-bf16": 0.4},
                     fail=BuildFailed("the process exporting openvino-bf16 was killed by SIGKILL"))
    gate.set()
    with (caplog.at_level("WARNING", logger="ibedl.engine.backend_switch"),
          make_client(loader=unmeasured_loader, artifact=bf16_calibrated) as c):
        assert c.app.state.service.engine.versions.switcher.done.wait(30)
        r = c.post("/predict", json=Q)
        card = c.get("/v1/models").json()["data"][0]
    assert r.status_code == 200 and served(r) == ("torch", "torch-fp32")
    background = card["backend"]["background"]
    assert background["state"] == "done" and background["switches"] == []
    assert background["failed"] == {"openvino-bf16": "BuildFailed: the process exporting openvino-bf16 was killed "
                                                     "by SIGKILL"}
    assert "building openvino-bf16 failed (BuildFailed: the process exporting openvino-bf16 was killed by SIGKILL); " \
           "still serving torch" in caplog.text


def test_switching_off_serves_the_start_choice_only(make_client, bf16_calibrated, switching):
    switching({"torch": 1.0, "openvino-bf16": 0.4}).set()
    with make_client(loader=unmeasured_loader, artifact=bf16_calibrated, backend_switching=False) as c:
        r = c.post("/predict", json=Q)
        card = c.get("/v1/models").json()["data"][0]
        assert c.app.state.service.engine.versions.switcher is None
    assert served(r) == ("torch", "torch-fp32") and card["backend"]["background"] is None


def two_candidates(tiny_artifact, tmp_path, monkeypatch, pending: list[str]):
    """(the tiny artifact calibrated on torch, bf16 and fp32, a loader that leaves ``pending`` to build in that
    order)."""
    monkeypatch.setenv("IBEDL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(openvino_ir, "native_bf16", lambda: True)
    artifact = recalibrated(tiny_artifact, tmp_path / "two", "torch-fp32", {"openvino-bf16": {}, "openvino-fp32": {}})

    def loader(settings):
        predictor = unmeasured_loader(settings)
        predictor.backend_choice.pending = list(pending)
        return predictor

    return artifact, loader


def test_the_torch_weights_go_as_soon_as_torch_is_beaten(make_client, tiny_artifact, tmp_path, monkeypatch,
                                                         switching):
    """A replica has 2 GiB: once a trunk beats torch, the torch model is dropped before the next candidate is built,
    not when every candidate has been timed (the tournament never returns to a champion it beat)."""
    artifact, loader = two_candidates(tiny_artifact, tmp_path, monkeypatch, ["openvino-bf16", "openvino-fp32"])
    model_at_build: dict[str, bool] = {}
    gate = switching({"torch": 1.0, "openvino-bf16": 0.4, "openvino-fp32": 0.6},
                     on_build=lambda switcher, name: model_at_build.setdefault(
                         name, switcher.engine.runtimes[switcher.adapter].predictor.model is not None))
    gate.set()
    with make_client(loader=loader, artifact=artifact) as c:
        assert c.app.state.service.engine.versions.switcher.done.wait(30)
        r = c.post("/predict", json=Q)
        background = c.get("/v1/models").json()["data"][0]["backend"]["background"]
    assert background["state"] == "done" and background["failed"] == {}
    assert served(r) == ("openvino-bf16", "openvino-bf16") and background["seconds"]["openvino-fp32"] == 0.6
    assert background["switches"] == [{"from": "torch", "to": "openvino-bf16"}]
    assert model_at_build == {"openvino-bf16": True, "openvino-fp32": False}


def test_a_beaten_trunk_is_freed_once_a_faster_one_serves(make_client, tiny_artifact, tmp_path, monkeypatch,
                                                          switching):
    """torch -> fp32 -> bf16: after the second switch nothing holds the fp32 trunk (its compiled model's memory goes
    back), and the torch model is gone."""
    artifact, loader = two_candidates(tiny_artifact, tmp_path, monkeypatch, ["openvino-fp32", "openvino-bf16"])
    gate = switching({"torch": 1.0, "openvino-fp32": 0.6, "openvino-bf16": 0.4})
    gate.set()
    with make_client(loader=loader, artifact=artifact) as c:
        state = c.app.state.service
        assert state.engine.versions.switcher.done.wait(30)
        r = c.post("/predict", json=Q)
        background = c.get("/v1/models").json()["data"][0]["backend"]["background"]
        gc.collect()
        assert background["state"] == "done" and served(r) == ("openvino-bf16", "openvino-bf16")
        assert [s["to"] for s in background["switches"]] == ["openvino-fp32", "openvino-bf16"]
        assert gate.built["openvino-fp32"]() is None and gate.built["openvino-bf16"]() is not None
        assert state.engine.default.predictor.model is None and state.engine.versions.switcher.shadow.model is None


def test_a_child_build_killed_for_memory_says_why_and_how_to_avoid_it(monkeypatch, tmp_path):
    import subprocess

    from ibedl.core import memory_limit

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, -9, "", "a warning\n"))
    monkeypatch.setattr(memory_limit, "container_limit_bytes", lambda: 2 << 30)
    with pytest.raises(BuildFailed, match=r"exporting openvino-int8 was killed by SIGKILL \(probably out of memory: "
                       r"the container allows 2048 MiB; export the openvino-int8 IR ahead of serving, where there is "
                       r"room: python -m ibedl.core.measure_backends --artifact DIR, as the image does\)$"):
        build_in_child("openvino-int8", tmp_path, None, None)


def test_a_child_build_that_fails_says_how(tmp_path):
    with pytest.raises(BuildFailed, match="the process exporting openvino-fp32 exited with 1: .*no-artifact"):
        build_in_child("openvino-fp32", tmp_path / "no-artifact", None, None)


def test_the_torch_model_itself_is_freed_once_a_trunk_serves(make_client, bf16_calibrated, switching):
    """Not only the serving predictor's attribute: no runtime, batcher, shadow or switcher keeps the torch model object
    alive once a trunk serves (a switch keeps the old runtime whole for the passes queued on it; once it is beaten
    nothing may hold it), so with a real trunk its weights' memory can go back (here the fake trunk computes with
    torch's decoder, which stays)."""
    gate = switching({"torch": 1.0, "openvino-bf16": 0.4})
    with make_client(loader=unmeasured_loader, artifact=bf16_calibrated) as c:
        state = c.app.state.service
        model = weakref.ref(state.engine.default.predictor.model)
        assert served(c.post("/predict", json=Q)) == ("torch", "torch-fp32")  # a pass on the torch runtime first
        gate.set()
        assert state.engine.versions.switcher.done.wait(30)
        gc.collect()
        assert model() is None  # before any pass on the trunk: the last pass on torch holds nothing either
        assert served(c.post("/predict", json=Q)) == ("openvino-bf16", "openvino-bf16")


def test_a_switch_collects_and_refreezes_the_heap_once_its_requests_are_over(make_client, bf16_calibrated, switching,
                                                                             unfrozen):
    """With IBEDL_GC_FREEZE on, the torch model frozen at start is still freed when a trunk beats it (dropping a model
    collects the frozen heap too), and the switch leaves a refreeze due request_timeout_s later."""
    from ibedl.engine.heap import HeapFreezer

    gate = switching({"torch": 1.0, "openvino-bf16": 0.4})
    with make_client(loader=unmeasured_loader, artifact=bf16_calibrated, gc_freeze=True, request_timeout_s=0.5) as c:
        state = c.app.state.service
        (freezer,) = [o for o in state.engine.observers if isinstance(o, HeapFreezer)]
        model = weakref.ref(state.engine.default.predictor.model)
        assert freezer.frozen > 0 and model() is not None
        freezer.refrozen.clear()
        gate.set()
        assert state.engine.versions.switcher.done.wait(30)
        assert model() is None  # frozen at start, freed by the drop without a test's gc.collect
        assert c.portal.call(lambda: asyncio.wait_for(freezer.refrozen.wait(), 30)) is True
        assert served(c.post("/predict", json=Q)) == ("openvino-bf16", "openvino-bf16")


def test_nothing_holds_the_start_runtime_once_the_tournament_is_over(make_client, bf16_calibrated, switching):
    """The switcher lets go of the runtime it started from as soon as the tournament is over, before the model's drop
    collects the heap (a frozen heap's cycles are freed there, or at the next freeze), not when its thread ends."""
    gate = switching({"torch": 1.0, "openvino-bf16": 0.4})
    with make_client(loader=unmeasured_loader, artifact=bf16_calibrated) as c:
        engine = c.app.state.service.engine
        start = weakref.ref(engine.default)
        settle, alive_at_settle = engine.versions.settle_backend, []

        def settling(*args):
            alive_at_settle.append(start() is not None)
            return settle(*args)

        engine.versions.settle_backend = settling
        gate.set()
        assert engine.versions.switcher.done.wait(30)
        assert alive_at_settle == [False] and engine.default is not None  # no gc.collect: nothing held it


def test_the_start_runtime_goes_at_the_first_switch_not_after_the_tournament(make_client, tiny_artifact, tmp_path,
                                                                              monkeypatch, switching):
    """torch -> bf16, then fp32 built and timed: by fp32's build nothing holds the runtime torch served from (its
    model's memory can go back while the tournament goes on)."""
    artifact, loader = two_candidates(tiny_artifact, tmp_path, monkeypatch, ["openvino-bf16", "openvino-fp32"])
    start, alive_at_build = [], {}
    gate = switching({"torch": 1.0, "openvino-bf16": 0.4, "openvino-fp32": 0.6},
                     on_build=lambda switcher, name: alive_at_build.setdefault(name, start[0]() is not None))
    with make_client(loader=loader, artifact=artifact) as c:
        engine = c.app.state.service.engine
        start.append(weakref.ref(engine.default))
        gate.set()
        assert engine.versions.switcher.done.wait(30)
        assert [s["to"] for s in engine.versions.switcher.status["switches"]] == ["openvino-bf16"]
    assert alive_at_build == {"openvino-bf16": True, "openvino-fp32": False}  # no gc.collect: nothing held it


class Preparing(Trunk):
    """A trunk that asks for steps on the thread that will call it before it serves, as a graphed CUDA trunk asks to
    capture its graphs (ibedl.core.backends.cuda_graphs): each step records its thread and whether the trunk had
    answered yet; ``fail`` makes the second step raise."""

    fail: Exception | None = None

    def __init__(self, decoder, name: str) -> None:
        super().__init__(decoder, name)
        self.ran: list[tuple[str, bool]] = []

    def prepare(self):
        for i in range(3):
            yield lambda i=i: self.step(i)

    def step(self, i: int) -> None:
        if i == 1 and self.fail is not None:
            raise self.fail
        self.ran.append((threading.current_thread().name, self.name in LAST))


def test_a_trunk_is_prepared_on_the_model_thread_before_it_is_timed(make_client, bf16_calibrated, switching):
    LAST.clear()
    built: list[Preparing] = []
    gate = switching({"torch": 1.0, "openvino-bf16": 0.4}, make=lambda d, n: built.append(Preparing(d, n)) or built[-1])
    gate.set()
    with make_client(loader=unmeasured_loader, artifact=bf16_calibrated) as c:
        assert c.app.state.service.engine.versions.switcher.done.wait(30)
        r = c.post("/predict", json=Q)
    assert served(r) == ("openvino-bf16", "openvino-bf16")
    (trunk,) = built
    assert len(trunk.ran) == 3 and all(t.startswith("ibedl-model") and not answered for t, answered in trunk.ran)


def test_a_preparation_that_fails_is_a_failed_build(make_client, bf16_calibrated, switching, monkeypatch):
    from ibedl.core.backends.cuda_graphs import GraphCaptureError

    monkeypatch.setattr(Preparing, "fail", GraphCaptureError("capturing the CUDA graph of 64 questions x 256 tokens "
                                                             "failed: OutOfMemoryError: CUDA out of memory"))
    switching({"torch": 1.0, "openvino-bf16": 0.4}, make=Preparing).set()
    with make_client(loader=unmeasured_loader, artifact=bf16_calibrated) as c:
        assert c.app.state.service.engine.versions.switcher.done.wait(30)
        r = c.post("/predict", json=Q)
        card = c.get("/v1/models").json()["data"][0]
    assert r.status_code == 200 and served(r) == ("torch", "torch-fp32")
    assert card["backend"]["background"]["failed"] == {
        "openvino-bf16": "GraphCaptureError: capturing the CUDA graph of 64 questions x 256 tokens failed: "
                         "OutOfMemoryError: CUDA out of memory"}


def test_the_card_says_how_a_graphed_trunk_ran_its_forwards(make_client, bf16_calibrated, switching):
    """A trunk replayed from CUDA graphs (here on the CPU, its capture a stand-in that reruns the forward) is
    prepared whole before it is timed, and ``GET /v1/models`` says what it captured and how its forwards ran."""
    import torch

    from ibedl.core.backends.cuda_graphs import GraphedTrunk
    from tests.core.test_backends_cuda_graphs import Captures

    class Eager:  # what GraphedTrunk wraps (ibedl.core.backends.torch_cuda.TorchTrunk's parts)
        def __init__(self, decoder):
            self.model, self.gather, self.device = decoder, openvino_ir.LastTokenTrunk(decoder), torch.device("cpu")

        def __call__(self, batch):
            return self.gather(batch.input_ids, batch.attention_mask, batch.last_index)

    class Timed(GraphedTrunk):  # the injected timer reads which trunk ran last
        def __call__(self, batch):
            LAST.append("openvino-bf16")
            return super().__call__(batch)

    shapes = [(b, n) for b in (1, 2) for n in (64, 128, 256)]
    switching({"torch": 1.0, "openvino-bf16": 0.4},
              make=lambda decoder, name: Timed(Eager(decoder), shapes, Captures())).set()
    with make_client(loader=unmeasured_loader, artifact=bf16_calibrated) as c:
        assert c.app.state.service.engine.versions.switcher.done.wait(30)
        card = c.get("/v1/models").json()["data"][0]["backend"]
        assert card["background"]["failed"] == {}, card["background"]
        before = card["forwards"]
        assert served(c.post("/predict", json=Q)) == ("openvino-bf16", "openvino-bf16")
        after = c.get("/v1/models").json()["data"][0]["backend"]["forwards"]
    assert before["captured"] == len(shapes) and before["eager"] == before["masked"] == 0
    assert after == {**before, "replays": before["replays"] + 1}
