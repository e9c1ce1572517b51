"""All service settings, from ``IBEDL_*`` environment variables (one pydantic-settings class)."""

from __future__ import annotations

from pathlib import Path

from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    """Service settings; every field reads ``IBEDL_<NAME>`` (e.g. ``IBEDL_MAX_BATCH_SIZE=32``)."""

    model_config = SettingsConfigDict(env_prefix="IBEDL_", extra="ignore")

    artifact: Path = Field(Path("artifacts/default"), description="adapter directory to serve (one adapter)")
    artifacts: Annotated[list[Path], NoDecode] = Field(
        [], description="several adapter directories, comma-separated, served on one shared base model (the first "
        "is the default; a request picks one with its 'adapter' field); when set, IBEDL_ARTIFACT is ignored")
    base_model: str | None = Field(None, description="override the manifest's base model reference")
    allow_base_mismatch: bool = Field(False, description="serve even if the base weights' sha256 differs")
    device: str | None = Field(None, description="cpu or cuda[:i]; default CUDA when present")
    load_in_4bit: bool = Field(False, description="bitsandbytes NF4 on CUDA")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    backend: str = Field("torch", description="inference backend of the trunk: torch, openvino-fp32 (1.5x the "
                         "throughput on CPU, same answers, about 0.9 GB more memory), openvino-bf16 (the same IR with "
                         "bfloat16 matmuls: 2.4x, probabilities moved by up to 0.09; CPUs with AVX512-BF16/AMX), "
                         "openvino (int8 weights), auto (openvino-fp32 on the CPU, torch on CUDA or for "
                         "MC-Dropout/ensembles)")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_token: SecretStr | None = Field(None, description="require 'Authorization: Bearer <token>' on the API routes")
    log_level: str = "info"
    log_format: str = Field("text", description="json: one JSON object per log line (the container images set "
                            "it); text: human-readable lines")

    max_batch_size: int = Field(16, ge=1, le=512, description="questions per forward pass")
    max_batch_tokens: int = Field(2048, ge=16, description="prompt tokens per forward pass (bounds how long one "
                                  "pass holds the model; a longer single question runs alone)")
    max_wait_ms: float = Field(5.0, ge=0, le=1000, description="how long a batch waits for more questions")
    queue_size: int = Field(256, ge=1, description="questions waiting, at most (a memory bound; admission by "
                            "capacity refuses earlier)")
    request_timeout_s: float = Field(30.0, gt=0, description="a request's deadline from its arrival; a client may "
                                     "ask for a shorter one with the X-Request-Timeout header (seconds)")
    admission_margin: float = Field(1.5, ge=1, le=10, description="admit a request only if this many times its "
                                    "expected completion fits before its deadline (else 503 + Retry-After at once)")
    max_request_tokens: int = Field(16384, ge=16, description="prompt tokens in one request, all its questions")
    body_timeout_s: float = Field(10.0, gt=0, description="time to receive a request body (else 408)")
    shutdown_grace_s: float = Field(30.0, ge=0, description="drain time on SIGTERM: what cannot finish in it gets "
                                    "503 + Retry-After")

    max_batch_items: int = Field(32, ge=1, description="items in one POST /predict/batch")
    max_options: int = Field(26, ge=2, le=26)
    max_question_chars: int = Field(4000, ge=1)
    max_option_chars: int = Field(1000, ge=1)
    max_context_chars: int = Field(20000, ge=0)
    max_tokens: int = Field(1024, ge=16,
                            description="prompt tokens after formatting (training may have cut passages shorter)")
    max_body_bytes: int = Field(1_000_000, ge=1024)

    drift_window: int = Field(500, ge=10, description="served uncertainty masses in the rolling window")
    drift_alarm_rate: float = Field(0.01, gt=0, lt=0.5, description="false-alarm rate the KS threshold is set for")
    drift_bootstrap: int = Field(1000, ge=50, description="bootstrap draws calibrating the KS threshold")

    def served_artifacts(self) -> list[Path]:
        """The adapter directories to serve, the default first."""
        return list(self.artifacts) or [self.artifact]

    @field_validator("artifacts", mode="before")
    @classmethod
    def _split(cls, v):
        if isinstance(v, str):
            v = [part.strip() for part in v.split(",") if part.strip()]
        return v

    @model_validator(mode="after")
    def _distinct(self):
        names = [str(p) for p in self.artifacts]
        if len(set(names)) != len(names):
            raise ValueError(f"IBEDL_ARTIFACTS lists a directory twice: {names}")
        return self

    @field_validator("log_format")
    @classmethod
    def _format(cls, v: str) -> str:
        if v.lower() not in ("json", "text"):
            raise ValueError(f"log_format must be json or text, got {v!r}")
        return v.lower()

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        from ibedl.core.backends import check_backend

        return check_backend(v)

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        levels = ("critical", "error", "warning", "info", "debug")
        if v.lower() not in levels:
            raise ValueError(f"log_level must be one of {levels}, got {v!r}")
        return v.lower()
