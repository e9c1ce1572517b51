"""Request and response bodies of the API (pydantic models; they make the OpenAPI schema)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from ibedl.engine.errors import too_many_items

# The most items one request may carry (IBEDL_MAX_BATCH_ITEMS) while a door validates its body: set, a longer list of
# items is refused before any item is validated (type "too_large"; building tens of thousands of items, which a 1 MB
# body holds, took the event loop a second). Unset (the Python API), the engine's own check applies alone.
ITEMS_LIMIT: ContextVar[int | None] = ContextVar("ITEMS_LIMIT", default=None)


def within_items_limit(items):
    """``items`` (the raw list, before its items are validated), or PydanticCustomError "too_large" past
    ITEMS_LIMIT."""
    limit = ITEMS_LIMIT.get()
    if limit is not None and isinstance(items, list) and len(items) > limit:
        raise PydanticCustomError("too_large", too_many_items(len(items), limit))
    return items

ADAPTER_NAME_CHARS = 128  # the longest adapter name a request may give (a served one is its manifest's `name`)


class AbstainOptions(BaseModel):
    """Per-request thresholds; they can only tighten the adapter's defaults."""

    # strict: a threshold is a JSON number; `false` or "0.5" is a client's mistake (422), not 0.0 or 0.5
    model_config = ConfigDict(extra="forbid", strict=True)

    max_uncertainty: float | None = Field(None, ge=0.0, le=1.0, description="abstain when u is above this")
    min_confidence: float | None = Field(None, ge=0.0, le=1.0, description="abstain when max p is below this")


class ConformalOptions(BaseModel):
    """Which stored prediction set to return; GET /v1/models lists the stored alphas and scores."""

    model_config = ConfigDict(extra="forbid", strict=True)

    alpha: float | None = Field(None, gt=0.0, lt=1.0, description="miscoverage: the set holds the answer with "
                                "probability >= 1 - alpha (one of the adapter's stored alphas)")
    score: Literal["lac", "aps"] | None = Field(None, description="non-conformity score: lac (smallest sets) or aps "
                                                "(adaptive); default the adapter's")


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
        ..., description="2..max_options option texts (GET /v1/models; at most 26), as a list or as a map of "
        "consecutive letters A.. to texts; none blank"
    )
    context: str | None = Field(None, description="an optional passage the question is about")
    abstain: AbstainOptions | None = None
    conformal: ConformalOptions | None = None
    id: str | None = Field(None, max_length=256, description="echoed back in the response")
    adapter: str | None = Field(None, max_length=ADAPTER_NAME_CHARS,
                                description="which served adapter answers (GET /v1/models lists them); "
                                "default the first; every item of a batch must name the same one")


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[PredictRequest] = Field(..., min_length=1, description="questions, answered in order")

    _within_limit = field_validator("items", mode="before")(within_items_limit)


class PredictedOption(BaseModel):
    letter: str
    index: int
    text: str


class AdapterRef(BaseModel):
    name: str
    method: str
    version: str
    backend: str = Field(..., description="the inference backend that computed the answer (IBEDL_BACKEND, auto "
                         "resolved)")
    calibration: str = Field(..., description="the backend and precision the thresholds and conformal quantiles "
                             "were calibrated on (the backend's own unless IBEDL_ALLOW_UNCALIBRATED_BACKEND)")


NoPromiseReason = Literal["option_count_not_calibrated", "violated_by_feedback"]


class StatedGuarantees(BaseModel):
    """What the adapter's calibration promises for one answer, if served questions are exchangeable with the
    calibration sample (GET /v1/guarantees reports what labelled feedback measured). Where no promise holds, no
    level is stated: every level below is null and ``reason`` says why."""

    holds: bool | None = Field(..., description="whether the promises below hold for this answer: false means none "
                               "does (see reason) and every level is null; null when the calibration does not record "
                               "its option counts (an older artifact)")
    reason: NoPromiseReason | None = Field(None, description="why no promise holds (null when they hold): "
                                           "'option_count_not_calibrated' (the calibration sample had too few "
                                           "questions with this many options: the gate, the answer threshold and the "
                                           "set were never calibrated for it), 'violated_by_feedback' (labels sent "
                                           "back showed a promise of this adapter version broken: its promises are "
                                           "suspended until a recalibrated version replaces it)")
    since: str | None = Field(None, description="with 'violated_by_feedback': when the violation was detected "
                              "(ISO 8601, UTC)")
    option_counts: list[int] | None = Field(..., description="the option counts the calibration claims")
    answered_accuracy: float | None = Field(..., description="answered in-distribution questions are right at "
                                            "least this often (the risk-controlled threshold's target); null when no "
                                            "threshold was certified or no promise holds")
    answered_accuracy_delta: float | None = Field(..., description="the probability, over the calibration draw, "
                                                  "that the served threshold misses answered_accuracy")
    set_coverage: float | None = Field(..., description="1 - alpha of the prediction set; null without sets or "
                                       "when no promise holds")
    set_coverage_delta: float | None = Field(..., description="the probability, over the calibration draw, that the "
                                             "served set rule covers less than set_coverage (training-conditional "
                                             "quantiles); null: marginal coverage, an average over calibration "
                                             "draws")
    gate_refusal_rate: float | None = Field(None, description="the gate refuses at most this share of "
                                            "in-distribution questions as out of distribution; null without a gate "
                                            "or when no promise holds")
    gate_refusal_delta: float | None = Field(None, description="the probability, over the calibration draw, that "
                                             "the served gate refuses more than gate_refusal_rate "
                                             "(training-conditional); null: on average over calibration draws")


class PredictResponse(BaseModel):
    id: str
    prediction: PredictedOption
    probabilities: dict[str, float] = Field(..., description="expected probabilities per letter")
    belief_masses: dict[str, float] | None = Field(...,
                                                   description="Dirichlet belief masses (null without a Dirichlet)")
    uncertainty_mass: float | None = Field(..., description="u = C / alpha0 (null without a Dirichlet)")
    confidence: float = Field(..., description="max probability")
    sigma: dict[str, float] | None = Field(..., description="std of the pre-evidence per letter (IB-EDL)")
    ood_score: float = Field(..., description="in-distribution score the gate compares with its threshold: 1/u "
                             "with a Dirichlet, max probability without; higher is more typical")
    prediction_set: list[str] | None = Field(..., description="conformal prediction set (letters, most probable "
                                             "first): holds the right answer with probability >= "
                                             "prediction_set_coverage on in-distribution questions; null when the "
                                             "adapter was never calibrated (ibedl.training.calibrate)")
    prediction_set_coverage: float | None = Field(..., description="1 - alpha of the set; null when no promise "
                                                  "holds for this answer (guarantees.reason)")
    prediction_set_score: Literal["lac", "aps"] | None = Field(..., description="the set's non-conformity score")
    abstained: bool
    abstain_reason: Literal["out_of_distribution", "max_uncertainty", "min_confidence"] | None = Field(
        ..., description="null when answered; 'out_of_distribution' when the OOD score is below the gate's "
        "threshold, 'max_uncertainty' when u is above the limit, 'min_confidence' when max p is below the "
        "risk-controlled threshold")
    adapter: AdapterRef
    adaptive_prediction_set: list[str] | None = Field(
        None, description="the adaptive conformal set (letters, most probable first) whose threshold follows the "
        "labels sent back (IBEDL_ADAPTIVE_SETS); its long-run coverage on the labelled stream is reported apart "
        "from prediction_set's guarantee (GET /v1/guarantees, adaptive_set_coverage); the most probable option "
        "alone when the threshold is below every option's score (counted as a miss, so it covers at least as "
        "often as reported); null when off")
    receipt: str | None = Field(None, description="signed receipt of this answer: send it back with the right "
                                "option to POST /v1/feedback; null when feedback is off (no IBEDL_FEEDBACK_KEY)")
    guarantees: StatedGuarantees | None = Field(None, description="what the calibration promises for this "
                                                "answer, with each level's delta, and whether it holds at all for "
                                                "this many options")


class BatchResponse(BaseModel):
    results: list[PredictResponse]


class FeedbackRequest(BaseModel):
    """The right option of one answered question."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"receipt": "v1.eyJ...J9.3q2-...",
                                                                               "label": "B"}]})

    receipt: str = Field(..., min_length=1, max_length=4096, description="the 'receipt' of the /predict answer")
    label: str = Field(..., pattern="^[A-Z]$", description="the right option's letter (A, B, ...; one of the "
                       "question's)")


class FeedbackBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[FeedbackRequest] = Field(..., min_length=1, description="labels, recorded all or none")

    _within_limit = field_validator("items", mode="before")(within_items_limit)


class FeedbackResult(BaseModel):
    receipt_id: str
    question: str = Field(..., description="the answer's id")
    adapter: str
    version: str
    status: Literal["recorded", "duplicate"] = Field(..., description="duplicate: this receipt was recorded before "
                                                     "(by any replica); it counts once")
    correct: bool | None = Field(..., description="the answer was right; null when the service abstained")
    covered: bool | None = Field(..., description="the prediction set held the label; null without a set")


class FeedbackResponse(BaseModel):
    recorded: int = Field(..., description="labels counted by this request")
    duplicates: int = Field(..., description="labels of receipts recorded before (not counted again)")
    results: list[FeedbackResult]


class ChangeStatus(BaseModel):
    """A stated guarantee's change detector for one option count (ibedl.engine.change_detector)."""

    options: int
    labels: int = Field(..., description="labels it has read")
    statistic: float = Field(..., description="its mixture Shiryaev-Roberts statistic; an alarm at threshold, "
                             "after which it stays at its alarm value while labels go on counting")
    threshold: float
    alarm: bool
    change_seq: int | None = Field(..., description="at an alarm: the store sequence number of the first label of "
                                   "the change it estimated (calibrate --dataset feedback --since-change reads the "
                                   "labels from there)")


class Suspension(BaseModel):
    """Why labelled feedback suspended a version's promises."""

    since: str = Field(..., description="the time of the label that showed the promise broken (ISO 8601, UTC)")
    guarantee: str
    stated: float
    options: int = Field(..., description="the option count of the questions that showed it")
    by: Literal["change_detector", "confidence_sequence"] = Field(
        ..., description="change_detector: a change since some label; confidence_sequence: never held since the "
        "version started")
    label_seq: int = Field(..., description="the store sequence number of that label")
    change_seq: int | None = Field(..., description="the first label of the estimated change (change_detector)")


class Guarantee(BaseModel):
    adapter: str
    version: str
    served: bool = Field(..., description="this version is the one served now")
    guarantee: Literal["answered_accuracy", "set_coverage", "answered_share", "adaptive_set_coverage"]
    stated: float | None = Field(..., description="the stated level: the abstention's target accuracy, the sets' "
                                 "nominal coverage, the adaptive sets' target; null for answered_share")
    labels: int = Field(..., description="labelled questions it counts")
    hits: int = Field(..., description="of them: right answers, covering sets, answered questions")
    estimate: float | None = Field(..., description="hits / labels")
    lower: float = Field(..., description="lower end of the confidence sequence (valid under continuous monitoring)")
    upper: float = Field(..., description="upper end")
    violated: bool = Field(..., description="a served version whose upper < stated: the labels show the stated "
                           "guarantee has not held since the version started (false for a retired version: see "
                           "violated_before_retired)")
    changed: bool = Field(False, description="a served version whose change detector for some option count alarmed: "
                          "the guarantee stopped holding at some point (change: where)")
    violated_before_retired: bool = Field(False, description="a retired version whose labels showed this guarantee "
                                          "broken (kept for the record; never alerted on)")
    change: list[ChangeStatus] = Field(default_factory=list, description="the change detector of each option count "
                                       "(stated guarantees only)")
    suspended: Suspension | None = Field(None, description="a served version whose promises labelled feedback "
                                         "suspended (its answers say holds: false, violated_by_feedback), until a "
                                         "recalibrated version replaces it")
    retired: bool = Field(..., description="this replica does not serve this version (a newer one replaced it; "
                          "during a rollout, also the other replicas' version): its labels stay readable here, but "
                          "this replica exports no ibedl_guarantee_* gauges for it, so it never alerts from here")


class GuaranteesResponse(BaseModel):
    alpha: float = Field(..., description="each sequence holds the mean at all times with probability >= 1 - alpha")
    change_false_alarm: float | None = Field(None, description="the probability that a version's change detectors "
                                             "raise any false alarm within change_horizon labels")
    change_horizon: int | None = Field(None, description="labels over which change_false_alarm holds")
    conflicts: dict[str, int] = Field(default_factory=dict, description="labels this process refused because their "
                                      "receipt was recorded before with another label, by adapter (every door: "
                                      "HTTP, the Python API, the batch command)")
    shared_store: bool = Field(..., description="labels come from the store every replica shares (IBEDL_FEEDBACK_DB "
                               "or IBEDL_FEEDBACK_DSN); false: this replica's labels only")
    guarantees: list[Guarantee]


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
    statistic: str = Field(..., description="the monitored quantity: uncertainty_mass, or confidence without a "
                           "Dirichlet")
    window: int = Field(..., description="values in the rolling window")
    window_size: int
    reference_size: int
    ks: float | None
    psi: float | None
    ks_threshold: float | None
    alarm: bool
    window_mean: float | None
    reference_mean: float | None
    answered_in_window: int = Field(..., description="answered (not abstained) questions in the accuracy window")
    estimated_accuracy: float | None = Field(..., description="label-free estimate of the accuracy of answered "
                                             "questions in the window: the mean of their calibrated confidence")
    estimated_accuracy_interval: list[float] | None = Field(
        ..., description="95% interval of that estimate, assuming the probabilities are calibrated")
    target_accuracy: float | None = Field(..., description="the accuracy the adapter's abstention guarantees; null "
                                          "when its calibration could not certify one, or claims no promise for "
                                          "options")
    options: int | None = Field(None, description="the option count whose answers both windows hold (the drift "
                                "reference's); null: every count")


class ModelCard(BaseModel):
    """One served adapter, as GET /v1/models lists it."""

    id: str
    name: str
    version: str
    method: str
    method_config: dict
    base_model: dict
    training_data: dict | None
    label_noise: float | None
    created: str | None
    metrics: dict = Field(..., description="validation/test metrics recorded in the manifest")
    abstention: dict = Field(..., description="default thresholds: max_uncertainty, min_confidence, ood_score, "
                             "ood_threshold, and how they were chosen (target, delta, bound, coverage)")
    conformal: dict | None = Field(..., description="prediction sets: default alpha and score, the stored alphas "
                                   "a request may ask for, calibration size n, delta (training-conditional: the "
                                   "served sets cover >= 1 - alpha with probability >= 1 - delta over the "
                                   "calibration draw; null: marginal); null when never calibrated")
    calibrated_option_counts: list[int] | None = Field(None, description="the option counts the calibration "
                                                       "claims (each with enough questions of it): answers with "
                                                       "another count carry guarantees.holds = false; null when not "
                                                       "recorded")
    promises_suspended: Suspension | None = Field(None, description="why labelled feedback suspended this "
                                                  "version's promises (its answers say holds: false, "
                                                  "violated_by_feedback); null while they stand")
    calibration: dict | None = Field(..., description="what ibedl.training.calibrate did for the calibration in "
                                     "use: data, post-hoc fit, OOD gate, risk control; null when never calibrated")
    backend: dict = Field(..., description="the inference backend: name (auto resolved), requested (IBEDL_BACKEND), "
                          "reason (why auto chose it), measured (auto: seconds per batch of `batch` prompts of each "
                          "candidate timed, those skipped and why, when, whether read from an earlier start's "
                          "measurement; null when a backend was named), forwards (a trunk replayed from CUDA graphs: "
                          "graphs captured, replays, forwards without a graph; null for any other), background (auto "
                          "in the service: what the background measurement is doing, failed builds and why, switches; "
                          "null when none runs)")
    calibration_in_use: dict = Field(..., description="key: the backend and precision of the calibration served; "
                                     "backend_key: those of the backend that serves; matches_backend; carried: every "
                                     "calibration the artifact holds; metrics: those recorded under the one in use")
    prompt: dict
    max_options: int
    head: dict
    drift_statistic: str = Field(..., description="what GET /v1/drift?adapter=<id> monitors")


class ModelList(BaseModel):
    data: list[ModelCard]
