"""All service settings, from ``IBEDL_*`` environment variables (one pydantic-settings class): the engine's
(``ibedl.engine.settings.EngineSettings``: adapters, device, question limits) and what only HTTP needs."""

from __future__ import annotations

import ipaddress

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from ibedl.engine.settings import SECRETS, EngineSettings

TOKENS = ("api_token", "metrics_token", "label_token")
SECRET_SETTINGS = (*SECRETS, *TOKENS)  # never shown: not in logs, not in error messages


class Settings(EngineSettings):
    """Service settings; every field reads ``IBEDL_<NAME>`` (e.g. ``IBEDL_MAX_BATCH_SIZE=32``). The engine's
    fields come first (inherited); :meth:`engine` gives them to the engine alone."""

    model_config = SettingsConfigDict(env_prefix="IBEDL_", extra="ignore", hide_input_in_errors=True)

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_token: SecretStr | None = Field(None, description="require 'Authorization: Bearer <token>' on every route "
                                        "but the health probes and the docs' static assets (surrounding whitespace "
                                        "is dropped; empty is unset)")
    metrics_token: SecretStr | None = Field(None, description="require 'Authorization: Bearer <token>' on /metrics "
                                            "(Prometheus' credential); unset: /metrics takes IBEDL_API_TOKEN")
    label_token: SecretStr | None = Field(None, description="the labelling credential: POST /v1/feedback and "
                                          "/v1/feedback/batch require 'Authorization: Bearer <token>' with it, and "
                                          "refuse IBEDL_API_TOKEN (403); it opens no other route. Unset: labels are "
                                          "refused (403) unless the service runs without IBEDL_API_TOKEN on a "
                                          "loopback address (local use)")
    allow_anonymous: bool = Field(False, description="serve a non-loopback IBEDL_HOST without IBEDL_API_TOKEN "
                                  "(anyone who reaches the port may use the API; logged at start)")
    max_connections: int = Field(256, ge=1, description="open connections (and requests in progress) at most; a "
                                 "request over it gets 503 at once (uvicorn's limit_concurrency), the health "
                                 "probes excepted")
    header_timeout_s: float = Field(10.0, gt=0, description="time for a connection to send a request's headers "
                                    "(the first, and the next on a kept-alive connection); else it is closed")
    log_level: str = "info"
    log_format: str = Field("text", description="json: one JSON object per log line (the container images set "
                            "it); text: human-readable lines")

    grpc_port: int = Field(8001, ge=0, le=65535, description="port of the Open Inference Protocol over gRPC (KServe v2 "
                           "GRPCInferenceService), beside the HTTP port and behind the same token; 0: a free port "
                           "(logged)")
    grpc: bool = Field(True, description="serve the Open Inference Protocol over gRPC on IBEDL_GRPC_PORT")
    body_timeout_s: float = Field(10.0, gt=0, description="time to receive a request body (else 408)")
    max_body_bytes: int = Field(1_000_000, ge=1024)
    gc_freeze: bool = Field(True, description="once loaded, move the objects the start made out of Python's garbage "
                            "collector's scans (gc.freeze; again after a backend switch): its full collections "
                            "otherwise stall the event loop for about 0.25 s every 800 or so requests")

    drift_window: int = Field(500, ge=10, description="served uncertainty masses in the rolling window")
    drift_alarm_rate: float = Field(0.01, gt=0, lt=0.5, description="false-alarm rate the KS threshold is set for")
    drift_bootstrap: int = Field(1000, ge=50, description="bootstrap draws calibrating the KS threshold")

    @field_validator(*TOKENS, mode="before")
    @classmethod
    def _token(cls, v):
        """Surrounding whitespace dropped (a Secret file's trailing newline would lock every client out); an empty
        token is no token; one a client cannot send in a header (spaces, non-ASCII) is refused."""
        if isinstance(v, SecretStr):
            v = v.get_secret_value()
        if v is None:
            return None
        v = str(v).strip()
        if not v:
            return None
        bad = sorted({c for c in v if not "!" <= c <= "~"})
        if bad:
            raise ValueError(f"a token holds only visible ASCII characters (no spaces); this one has {len(bad)} "
                             "other character(s)")  # never the token itself
        return v

    @field_validator("label_token")
    @classmethod
    def _own_label_token(cls, v: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        """The labelling credential is a credential of its own: one that is also the API's or Prometheus' token
        would let every client (or the scraper) send labels."""
        for name in ("api_token", "metrics_token"):  # declared before label_token: already validated
            other = info.data.get(name)
            if v is not None and other is not None and other.get_secret_value() == v.get_secret_value():
                raise ValueError(f"the labelling credential must differ from IBEDL_{name.upper()}: it is given only "
                                 "to those whose labels count")  # never the token itself
        return v

    @model_validator(mode="after")
    def _two_ports(self):
        if self.grpc and self.grpc_port == self.port:
            raise ValueError(f"IBEDL_GRPC_PORT and IBEDL_PORT are both {self.port}: the gRPC door needs a port of its "
                             "own (or IBEDL_GRPC=false)")
        return self

    def exposed(self) -> bool:
        """Whether ``host`` is reachable from other machines (any address but a loopback one)."""
        if self.host == "localhost":
            return False
        try:
            return not ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            return True  # a host name other than localhost: assume it is reachable

    def labels_open(self) -> bool:
        """Whether labels are accepted without a credential: no IBEDL_LABEL_TOKEN, no IBEDL_API_TOKEN and a loopback
        address (local use: only this machine's clients reach the service)."""
        return self.label_token is None and self.api_token is None and not self.exposed()

    def metrics_secret(self) -> str | None:
        """The token /metrics requires: IBEDL_METRICS_TOKEN, else IBEDL_API_TOKEN, else none."""
        token = self.metrics_token or self.api_token
        return token.get_secret_value() if token else None

    @field_validator("log_format")
    @classmethod
    def _format(cls, v: str) -> str:
        if v.lower() not in ("json", "text"):
            raise ValueError(f"log_format must be json or text, got {v!r}")
        return v.lower()

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        levels = ("critical", "error", "warning", "info", "debug")
        if v.lower() not in levels:
            raise ValueError(f"log_level must be one of {levels}, got {v!r}")
        return v.lower()
