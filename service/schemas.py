"""Request and response bodies of the API (pydantic models; they make the OpenAPI schema)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class AbstainOptions(BaseModel):
    """Per-request thresholds; they can only tighten the adapter's defaults."""

    model_config = ConfigDict(extra="forbid")

    max_uncertainty: float | None = Field(None, ge=0.0, le=1.0, description="abstain when u is above this")
    min_confidence: float | None = Field(None, ge=0.0, le=1.0, description="abstain when max p is below this")


class PredictRequest(BaseModel):
    """One multiple-choice question."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "question": "Which gas do plants take in for photosynthesis?",
                    "options": ["oxygen", "carbon dioxide", "nitrogen", "helium"],
                },
                {
                    "question": "What does the passage say the boy bought?",
                    "options": {"A": "apples", "B": "bread", "C": "milk"},
                    "context": "The boy went to the market and bought bread.",
                    "abstain": {"max_uncertainty": 0.5},
                    "id": "q-17",
                },
            ]
        },
    )

    question: str = Field(..., min_length=1, description="the question stem")
    options: list[str] | dict[str, str] = Field(
        ..., description="2..26 option texts, as a list or as a map of consecutive letters A.. to texts"
    )
    context: str | None = Field(None, description="an optional passage the question is about")
    abstain: AbstainOptions | None = None
    id: str | None = Field(None, max_length=256, description="echoed back in the response")


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[PredictRequest] = Field(..., min_length=1, description="questions, answered in order")


class PredictedOption(BaseModel):
    letter: str
    index: int
    text: str


class AdapterRef(BaseModel):
    name: str
    method: str
    version: str


class PredictResponse(BaseModel):
    id: str
    prediction: PredictedOption
    probabilities: dict[str, float] = Field(..., description="expected probabilities per letter")
    belief_masses: dict[str, float] | None = Field(..., description="Dirichlet belief masses (null without a Dirichlet)")
    uncertainty_mass: float | None = Field(..., description="u = C / alpha0 (null without a Dirichlet)")
    confidence: float = Field(..., description="max probability")
    sigma: dict[str, float] | None = Field(..., description="std of the pre-evidence per letter (IB-EDL)")
    abstained: bool
    abstain_reason: str | None = Field(..., description="null, 'max_uncertainty' or 'min_confidence'")
    adapter: AdapterRef


class BatchResponse(BaseModel):
    results: list[PredictResponse]


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: str
    reason: str | None = None


class DriftStatus(BaseModel):
    statistic: str = Field(..., description="the monitored quantity: uncertainty_mass, or confidence without a Dirichlet")
    window: int = Field(..., description="values in the rolling window")
    window_size: int
    reference_size: int
    ks: float | None
    psi: float | None
    ks_threshold: float | None
    alarm: bool
    window_mean: float | None
    reference_mean: float | None
