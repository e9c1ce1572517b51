"""Shared fixtures: a tiny randomly initialised Llama with a real (trained) byte-level BPE tokenizer,
saved as a local HF directory, so the loading, predictor and training paths run in seconds; the service
process harness."""

from __future__ import annotations

import os
import string
import threading
from pathlib import Path

import pytest

from benchmarks.service_process import ServiceProcess  # noqa: F401  (the tests import it from here)

# Every service a test starts opens its gRPC door on a free port, never the fixed default (8001): tests run services
# side by side, and a developer's own service may hold it. A test that needs the port reads it from the door.
os.environ["IBEDL_GRPC_PORT"] = "0"
# Every engine a test starts checks requests on two threads, whatever this machine's cores would give by default (one
# on up to 7 cores): the path of several check threads runs on every machine.
os.environ.setdefault("IBEDL_CHECK_THREADS", "2")
# No service a test starts freezes its heap (IBEDL_GC_FREEZE), in this process or its own: a freeze collects the whole
# heap (0.2-0.4 s in a test process) and would carry into later tests. Tests that freeze ask for it (the ``unfrozen``
# fixture undoes it).
os.environ.setdefault("IBEDL_GC_FREEZE", "false")

# Under pytest-xdist (make test: TEST_WORKERS processes) each worker's torch, and every child process it starts,
# would take all the cores: N workers on N cores would run N x N threads, and the tests that bound real work by the
# clock (a lone client never refused, a queue's deadline) would meet cores taken by the other workers' threads.
# Each worker gets its share, set before anything imports torch (xdist names the worker count before conftest).
if _workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0):
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, str(max(1, len(os.sched_getaffinity(0)) // _workers)))

TINY_CORPUS = [
    "Question: What do plants need to make food? A. sunlight B. sand C. salt D. iron Answer: A",
    "Which planet is closest to the sun? Mercury Venus Earth Mars Answer: B",
    "The passage says the boy went to the market to buy apples and bread for his mother.",
] + [" ".join(f"{c}. option" for c in string.ascii_uppercase) + " Answer:"] * 5


def make_tiny_model(directory: Path, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TINY_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=fast.pad_token_id,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


def pytest_report_header(config):
    """The CPU's kind in the header of every run: a failure on another machine names it."""
    from ibedl.core.cpu_isa import describe

    return f"cpu: {describe()}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_jsonl(tmp_path_factory) -> Path:
    """60 toy questions with 3..5 options whose answer is always A, as a JSONL file."""
    import json
    import random

    words = ["sun", "moon", "water", "plant", "stone", "tree", "bird", "fish", "cloud", "river"]
    path = tmp_path_factory.mktemp("toy") / "toy.jsonl"
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(60):
            opts = rng.sample(words, rng.choice([3, 4, 5]))
            f.write(json.dumps({"question": f"Which is {opts[0]}?", "options": opts, "answer": 0}) + "\n")
    return path


def train_tiny(tiny_model_dir, tiny_jsonl, root, *overrides: str):
    """An adapter trained for 2 steps on the tiny model with ``overrides`` (method, name, ...) under ``root``."""
    from ibedl.training.config import load_config
    from ibedl.training.finetune import train

    cfg = load_config(None, [
        f"base_model={tiny_model_dir}", f"output={root / 'adapter'}",
        f"data={{train: [{{dataset: jsonl, path: {tiny_jsonl}}}], "
        f"validation: [{{dataset: jsonl, path: {tiny_jsonl}}}]}}",
        "optim.max_steps=2", "max_tokens=96", "progress=false",
        "device=cpu",  # on a CUDA machine too: the CUDA tests compare with a CPU-made (torch-fp32) calibration
        "min_per_count=10",  # the toy validation set has about 20 questions of each of 3, 4 and 5 options
        *overrides,
    ])
    return train(cfg)


@pytest.fixture(scope="session")
def tiny_artifact(tiny_model_dir, tiny_jsonl, tmp_path_factory):
    """An IB-EDL adapter trained for 2 steps on the tiny model (real artifact files, real loading)."""
    return train_tiny(tiny_model_dir, tiny_jsonl, tmp_path_factory.mktemp("artifact"),
                      "method=ib_edl", "name=tiny", "method_params.num_samples=2")


@pytest.fixture(scope="session")
def tiny_map_artifact(tiny_model_dir, tiny_jsonl, tmp_path_factory):
    """A MAP (softmax) adapter on the same tiny model as ``tiny_artifact``: a second adapter to serve beside it."""
    return train_tiny(tiny_model_dir, tiny_jsonl, tmp_path_factory.mktemp("artifact-map"),
                      "method=map", "name=tiny-map", "seed=1")


def shared_cache_dir() -> str:
    """The machine's model cache the real-model tests share (the base model is converted once per machine)."""
    return os.environ.get("IBEDL_CACHE_DIR_REAL") or str(Path.home() / ".cache" / "ibedl")


@pytest.fixture(scope="session")
def default_backends_ready():
    """The committed default adapter loaded once with IBEDL_BACKEND=auto from the shared cache, before the tests that
    start services on it: the base model is converted there (once per machine), and the log says what ``auto``
    starts on. Loading builds nothing (ibedl.core.auto_backend.start_choice): the first service that finds no cached
    measurement builds and times the candidates in the background, and later ones start on its winner."""
    from ibedl.core.predictor import Predictor

    before = os.environ.get("IBEDL_CACHE_DIR")
    os.environ["IBEDL_CACHE_DIR"] = shared_cache_dir()
    try:
        Predictor.from_artifact(Path(__file__).resolve().parents[1] / "artifacts" / "default", backend="auto")
    finally:
        if before is None:
            os.environ.pop("IBEDL_CACHE_DIR")
        else:
            os.environ["IBEDL_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Conversions and assembled GGUFs of unit tests go to a per-session temp dir, never ~/.cache;
    # integration tests opt back into the shared cache (see tests/integration/conftest.py).
    monkeypatch.setenv("IBEDL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "ibedl-cache"))


class Cycle:
    """An object reachable from itself: once nothing else holds it, only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def unfrozen(monkeypatch):
    """A test process's heap unfrozen before and after the test, and ibedl.core.memory_limit not remembering a
    freeze of its own."""
    import gc

    from ibedl.core import memory_limit

    gc.unfreeze()
    monkeypatch.setattr(memory_limit, "_frozen", False)
    yield
    gc.unfreeze()


def generations_hold(obj) -> bool:
    """Whether ``obj`` is in one of the cyclic collector's generations (a frozen object is in none: never walked)."""
    import gc

    return any(o is obj for o in gc.get_objects())


@pytest.fixture(scope="session")
def postgres_server():
    """One real PostgreSQL server for the session (tests/postgres.py), stopped and removed at the end."""
    from tests.postgres import PostgresServer

    with PostgresServer() as server:
        yield server


@pytest.fixture
def postgres_dsn(postgres_server, request):
    """The DSN (with its password) of a database of this test's own on the session's PostgreSQL server."""
    import re

    name = "t_" + re.sub(r"\W", "_", request.node.name.lower())[:40] + f"_{os.getpid()}"
    dsn = postgres_server.create_database(name)
    yield dsn
    postgres_server.drop_database(name)


def tokenizer_calls(monkeypatch, tokenizer, record=lambda text, called: text) -> list:
    """A list that gets ``record(text, called)`` for every call of a tokenizer of ``tokenizer``'s class (its copies
    too: the class's ``__call__`` is wrapped, as calling an instance looks it up there; ``called`` is the instance
    called), from now to the test's end."""
    calls: list = []
    kind = type(tokenizer)
    original = kind.__call__
    monkeypatch.setattr(kind, "__call__", lambda self, text, *a, **k: calls.append(record(text, self)) or original(
        self, text, *a, **k))
    return calls


def thread_recording_loader(threads: list[tuple[str, int]]):
    """The default loader, recording ``("load", thread id)`` when it loads and ``("predict", thread id)`` at every
    call of the model (the warm-up's and the passes')."""
    from ibedl.engine.runtime import load_predictors

    def load(settings):
        threads.append(("load", threading.get_ident()))
        predictors = load_predictors(settings)
        for predictor in predictors:
            original = predictor.predict

            def predict(questions, truncate_context=True, original=original):
                threads.append(("predict", threading.get_ident()))
                return original(questions, truncate_context)

            predictor.predict = predict
        return predictors

    return load
