"""The engine's settings: what loading adapters and answering questions need (the adapters, the device, the
limits a question is checked against), read from ``IBEDL_*`` environment variables like the service's. The HTTP
service's settings (``ibedl.serve.settings.Settings``) extend these with what only HTTP needs (bind address, API
token, body and header timeouts, drain time, drift windows). The scheduler's (batching, queue, deadlines, admission)
are here: every front door is scheduled by the engine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ibedl.core.cpu_isa import usable_cores

SECRETS = ("feedback_key", "feedback_dsn")  # the engine's secrets: never shown in logs or error messages


def settings_errors(e, secrets: tuple[str, ...] = SECRETS) -> str:
    """What is wrong with the settings (``e``: pydantic's ValidationError), one part per field with its variable and
    the value given (never one of ``secrets``'). A rule across settings (no field) is shown without its input: that
    is every setting given, secrets too."""
    parts = []
    for error in e.errors():
        name = ".".join(str(part) for part in error["loc"])
        if not name:
            parts.append(error["msg"])
            continue
        shown = "" if name.split(".")[0] in secrets or "input" not in error else f" (got {error['input']!r})"
        parts.append(f"IBEDL_{name.upper()}: {error['msg']}{shown}")
    return "; ".join(parts)


class EngineSettings(BaseSettings):
    """Engine settings; every field reads ``IBEDL_<NAME>`` (e.g. ``IBEDL_MAX_TOKENS=2048``). An unknown keyword is
    refused (``ibedl.load(api_token=...)`` is a mistake: the Python API has no HTTP settings)."""

    # an error names the setting and says what is wrong, but never quotes what was given (a key, a DSN's password)
    model_config = SettingsConfigDict(env_prefix="IBEDL_", extra="forbid", hide_input_in_errors=True)

    artifact: Path = Field(Path("artifacts/default"), description="adapter directory to serve (one adapter)")
    artifacts: Annotated[list[Path], NoDecode] = Field(
        [], description="several adapter directories, comma-separated, served on one shared base model (the first "
        "is the default; a request picks one with its 'adapter' field); when set, IBEDL_ARTIFACT is ignored")
    base_model: str | None = Field(None, description="override the manifest's base model reference")
    allow_base_mismatch: bool = Field(False, description="serve even if the base weights' sha256 differs")
    device: str | None = Field(None, description="cpu or cuda[:i]; default CUDA when present")
    load_in_4bit: bool = Field(False, description="bitsandbytes NF4 on CUDA")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    backend: str = Field("auto", description="inference backend of the trunk: auto (of the backends this machine "
                         "runs for which the artifact carries a calibration, the fastest, timed at start-up and "
                         "cached per machine), torch, openvino-fp32, openvino-bf16, openvino (int8 weights), "
                         "openvino-int8 (static int8), and on CUDA torch-cuda-fp32, torch-cuda-bf16, "
                         "torch-cuda-nf4-bf16 (NF4 weights, bitsandbytes), torch-cuda-merged-fp32 and "
                         "torch-cuda-merged-bf16 (the adapter folded into the weights), torch-cuda-graphs-fp32 and "
                         "torch-cuda-graphs-bf16 (that merged trunk replayed from CUDA graphs)")
    allow_uncalibrated_backend: bool = Field(False, description="serve on a backend for which the artifact carries "
                                             "no calibration, with the thresholds and conformal quantiles of the "
                                             "one it carries first (its guarantees were made on other arithmetic); "
                                             "off: such a service refuses to become ready")

    max_batch_size: int = Field(16, ge=1, le=512, description="questions per forward pass")
    max_options: int = Field(26, ge=2, le=26)
    max_question_chars: int = Field(4000, ge=1)
    max_option_chars: int = Field(1000, ge=1)
    max_context_chars: int = Field(20000, ge=0)
    max_tokens: int = Field(1024, ge=16,
                            description="prompt tokens after formatting (training may have cut passages shorter)")

    max_batch_tokens: int = Field(2048, ge=16, description="prompt tokens per forward pass, counted padded to the "
                                  "pass's longest prompt under IBEDL_PAD_FREELY (bounds how long one pass holds the "
                                  "model and its memory; a longer single question runs alone)")
    max_wait_ms: float = Field(5.0, ge=0, le=1000, description="how long a batch waits for more questions")
    pad_freely: bool = Field(False, description="a forward pass takes waiting questions whatever their prompt "
                             "lengths and runs them as one batch padded to the longest (meant for a GPU, where a "
                             "pass's time should depend little on its padding: not yet measured on one); off: a "
                             "pass takes questions within a factor 2 of its first one's length and runs them in "
                             "groups padded to at most 1.25x their real tokens, which pays on a CPU, where padding "
                             "is computed like real tokens")
    queue_size: int = Field(256, ge=1, description="questions waiting, at most (a memory bound; admission by "
                            "capacity refuses earlier)")
    request_timeout_s: float = Field(30.0, gt=0, description="a request's deadline from its arrival; a client may "
                                     "ask for a shorter one with the X-Request-Timeout header (seconds)")
    admission_margin: float = Field(1.5, ge=1, le=10, description="admit a request only if this many times its "
                                    "expected completion fits before its deadline (else 503 + Retry-After at once)")
    max_request_tokens: int = Field(16384, ge=16, description="prompt tokens in one request, all its questions")
    max_batch_items: int = Field(32, ge=1, description="items in one request (POST /predict/batch, an Open "
                                 "Inference Protocol infer)")
    check_threads: int | None = Field(None, ge=1, le=64, validate_default=True, description="threads that check "
                                      "requests before they are queued, each tokenising prompts on its own copy of "
                                      "the tokenizer (the service's made before it is ready, the Python API's on "
                                      "demand); default: a quarter of the cores this process may use (its "
                                      "affinity; a container's CPU limit is not read), 1 to 4 (on a GPU one thread "
                                      "can bound the service: benchmarks/results/check_threads_cpu.json)")

    feedback_key: SecretStr | None = Field(
        None, description="key that signs the receipt each answer carries (HMAC-SHA256, at least 16 characters); "
        "every replica needs the same one. Unset: feedback is off (answers carry no receipt, POST /v1/feedback "
        "answers 404)")
    feedback_db: Path | None = Field(
        None, description="SQLite file of the recorded labels (WAL mode), shared by every replica of one host (a "
        "label counts once whichever replica receives it); unset, and no IBEDL_FEEDBACK_DSN: kept in memory by "
        "this process only")
    feedback_dsn: SecretStr | None = Field(
        None, description="PostgreSQL connection URI of the feedback store, for replicas on several nodes "
        "(postgresql://USER:PASSWORD@HOST:5432/DATABASE?sslmode=require); its tables are created at start. A "
        "secret: never shown. Instead of IBEDL_FEEDBACK_DB")
    feedback_retention_days: int = Field(90, ge=0, description="days a raw label is kept; older ones are deleted "
                                         "once the store's checkpoint holds them (the realised guarantees keep "
                                         "counting them; a recalibration on the traffic reads only the kept ones). "
                                         "At least IBEDL_FEEDBACK_TTL_S, so a receipt's label is never forgotten "
                                         "while the receipt can still be sent; 0: kept for ever")
    feedback_timeout_s: float = Field(5.0, gt=0, le=60, description="the longest wait for the feedback store (a "
                                      "lock another replica holds, a slow or unreachable server) before a call "
                                      "gives up: 503 store_unavailable, Retry-After")
    feedback_ttl_s: int = Field(30 * 24 * 3600, ge=60, description="seconds after an answer that its receipt "
                                "accepts a label (default 30 days)")
    guarantee_alpha: float = Field(0.02, gt=0.0, lt=0.5, description="error probability of each realised "
                                   "guarantee's confidence sequence over the whole life of an adapter version (a "
                                   "false alarm on healthy traffic: <= alpha/2 per sequence, plus the calibration's "
                                   "delta)")
    change_false_alarm: float = Field(0.01, gt=0.0, lt=0.5, description="probability that the change detectors of "
                                      "one adapter version (every stated guarantee and option count together) raise "
                                      "a false alarm within IBEDL_CHANGE_HORIZON labels of healthy traffic; it "
                                      "grows linearly beyond. A healthy version's promises are suspended by "
                                      "mistake with probability <= delta per labelled option count (its threshold) + "
                                      "delta per set level and score clients use at that count + alpha/2 per "
                                      "stated level + this: with the defaults and one option count at one set level, "
                                      "2 x 0.01 + 0.02 + 0.01 = 5% over 100,000 labels")
    change_horizon: int = Field(100_000, ge=100, description="labels of one adapter version over which "
                                "IBEDL_CHANGE_FALSE_ALARM holds (the detectors' threshold is 2 x horizon / false "
                                "alarm: a longer horizon costs about log(horizon) more labels of delay)")
    adaptive_sets: bool = Field(False, description="answers also carry an adaptive conformal set whose threshold "
                                "follows the labels (ACI); needs feedback on")
    adaptive_rate: float = Field(0.01, gt=0.0, le=0.5, description="step of the adaptive sets' threshold per label")

    # serving: labels per credential, the background backend measurement, drain and reload
    max_labels: int = Field(5000, ge=1, description="labels the labelling credential may record per "
                            "IBEDL_LABEL_WINDOW_S, all replicas together (counted in the feedback store); more: 429 "
                            "with Retry-After (duplicates do not count)")
    label_window_s: int = Field(3600, ge=1, description="the window of IBEDL_MAX_LABELS, in seconds")
    backend_switching: bool = Field(True, description="IBEDL_BACKEND=auto: be ready at once on the cached "
                                     "measurement's winner (else torch) and build and time the other candidates in the "
                                     "background, switching to one proven faster; false: serve that start choice only")
    backend_max_age_s: float = Field(7 * 24 * 3600.0, gt=0, description="IBEDL_BACKEND=auto: a cached measurement "
                                     "older than this is taken again in the background (the start may have been busy)")
    shutdown_grace_s: float = Field(30.0, ge=0, description="drain time on SIGTERM: what cannot finish in it gets "
                                    "503 + Retry-After")

    reload_interval_s: float = Field(10.0, ge=0, description="seconds between looks at each served artifact's "
                                     "manifest.json: a newer version of the same weights (python -m "
                                     "ibedl.training.calibrate in place, e.g. --dataset feedback) is served from the "
                                     "next request on, without a restart (SIGHUP looks at once); and at the "
                                     "feedback store's new labels, so that a suspension another replica's labels "
                                     "made reaches this replica's answers; 0: only on SIGHUP")

    def served_artifacts(self) -> list[Path]:
        """The adapter directories to serve, the default first."""
        return list(self.artifacts) or [self.artifact]

    @field_validator("artifacts", mode="before")
    @classmethod
    def _split(cls, v):
        if isinstance(v, str):
            parts = [part.strip() for part in v.split(",") if part.strip()]
            if v.strip() and not parts:  # ",,": not unset, and not the default adapter either
                raise ValueError(f"IBEDL_ARTIFACTS names no directory: {v!r}")
            v = parts
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        from ibedl.core.base_model import device_named  # torch: imported only when a device is named

        return device_named(v)  # whether this machine has it is asked where a model is loaded (load_predictors)

    @model_validator(mode="after")
    def _distinct(self):
        names = [str(p) for p in self.artifacts]
        if len(set(names)) != len(names):
            raise ValueError(f"IBEDL_ARTIFACTS lists a directory twice: {names}")
        return self

    @field_validator("check_threads")
    @classmethod
    def _check_threads(cls, v: int | None) -> int:
        """Unset: a quarter of the cores this process may use, at least 1 and at most 4 (the model's thread and its
        torch workers keep the rest); read as an int from then on."""
        return max(1, min(4, usable_cores() // 4)) if v is None else v

    @field_validator("feedback_key", mode="before")
    @classmethod
    def _key_stripped(cls, v):
        """Surrounding whitespace dropped (a Secret file's trailing newline); empty is unset, as for the tokens."""
        raw = v.get_secret_value() if isinstance(v, SecretStr) else v
        if isinstance(raw, str):
            raw = raw.strip()
            return raw or None
        return v

    @field_validator("feedback_key")
    @classmethod
    def _key_length(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError(f"feedback_key must be at least 16 characters (e.g. openssl rand -hex 32), got "
                             f"{len(v.get_secret_value())}")  # its length, never the key
        return v

    @field_validator("feedback_dsn", mode="before")
    @classmethod
    def _dsn(cls, v):
        """Surrounding whitespace dropped and empty is unset (a Secret file's newline, compose's empty default); a
        DSN must be a PostgreSQL URI that parses. The message never quotes it: it holds a password."""
        raw = v.get_secret_value() if isinstance(v, SecretStr) else v
        if not isinstance(raw, str):
            return v
        raw = raw.strip()
        if not raw:
            return None
        if not raw.startswith(("postgresql://", "postgres://")):
            raise ValueError("feedback_dsn must be a PostgreSQL URI, postgresql://USER:PASSWORD@HOST:PORT/DATABASE "
                             "(this one does not start with postgresql://)")
        from psycopg import Error  # the serve extra's driver, only when a DSN is given
        from psycopg.conninfo import conninfo_to_dict

        try:
            conninfo_to_dict(raw)
        except Error:  # its message quotes the DSN
            raise ValueError("feedback_dsn does not parse as a PostgreSQL URI (check its quoting: a password with "
                             "@, : or / must be percent-encoded)") from None
        return raw

    @model_validator(mode="after")
    def _one_store(self):
        if self.feedback_db is not None and self.feedback_dsn is not None:
            raise ValueError("IBEDL_FEEDBACK_DB and IBEDL_FEEDBACK_DSN both name a feedback store: set one (SQLite "
                             "for the replicas of one host, PostgreSQL for several nodes)")
        days = self.feedback_retention_days
        if days and days * 86400 < self.feedback_ttl_s:
            raise ValueError(f"IBEDL_FEEDBACK_RETENTION_DAYS ({days}) is shorter than IBEDL_FEEDBACK_TTL_S "
                             f"({self.feedback_ttl_s} s, {self.feedback_ttl_s / 86400:g} days): a receipt whose label "
                             "was deleted could be labelled again and count twice")
        return self

    @model_validator(mode="after")
    def _adaptive_needs_feedback(self):
        if self.adaptive_sets and self.feedback_key is None:
            raise ValueError("IBEDL_ADAPTIVE_SETS needs IBEDL_FEEDBACK_KEY: adaptive sets follow the labels sent back")
        return self

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        from ibedl.core.backends import check_backend

        return check_backend(v)
