"""Checking a request before the model sees it: limits, option letters, the prompt's token count and the
conformal set asked for. Every refusal is an InvalidRequest or a TooLarge (ibedl.engine.errors) naming the
field."""

from __future__ import annotations

import re

from ibedl.core.artifact import Conformal
from ibedl.core.predictor import TokenizedQuestion, prompts_ids
from ibedl.core.prompt import LETTERS, MCQuestion
from ibedl.engine.errors import InvalidRequest, TooLarge
from ibedl.engine.runtime import AdapterRuntime
from ibedl.engine.schemas import PredictRequest
from ibedl.engine.settings import EngineSettings

# The characters str.isspace() calls whitespace, spelled out: Python's, ECMA's and Rust's \s each differ, and the
# OpenAPI schema carries NOT_BLANK as a pattern that every client and validator must read the same way.
WHITESPACE = r"\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
NOT_BLANK = f"[^{WHITESPACE}]"  # a text is blank unless it holds a character outside WHITESPACE
_NOT_BLANK = re.compile(NOT_BLANK)


def blank(text: str) -> bool:
    return _NOT_BLANK.search(text) is None


def max_options(settings: EngineSettings, runtime: AdapterRuntime | None) -> int:
    """The most options a question may have: ``IBEDL_MAX_OPTIONS``, or fewer when the adapter's head has fewer
    rows (``runtime`` None: not loaded yet)."""
    return min(settings.max_options, runtime.predictor.num_rows if runtime else settings.max_options)


def to_question(runtime: AdapterRuntime, settings: EngineSettings, req: PredictRequest,
                prefix: str = "") -> MCQuestion:
    """Check limits and convert for the adapter ``runtime``; ``prefix`` locates the item in a batch
    (``items.3.``). Its prompt's tokens are checked next (:func:`tokenized`, :func:`within_tokens`)."""
    s = settings
    if isinstance(req.options, dict):
        keys = list(req.options)
        expected = list(LETTERS[: len(keys)])
        if sorted(keys) != expected:
            raise InvalidRequest(f"option letters must be consecutive from A, got {keys}", prefix + "options")
        options = [req.options[k] for k in expected]
    else:
        options = list(req.options)
    limit = max_options(settings, runtime)
    if not 2 <= len(options) <= limit:
        raise InvalidRequest(f"a question needs 2..{limit} options, got {len(options)}", prefix + "options")
    if blank(req.question):
        raise InvalidRequest("question must not be blank", prefix + "question")
    if len(req.question) > s.max_question_chars:
        raise TooLarge(f"question is {len(req.question)} characters; the limit is {s.max_question_chars}",
                       prefix + "question")
    for i, text in enumerate(options):
        if blank(text):
            raise InvalidRequest(f"option {LETTERS[i]} must not be blank", f"{prefix}options.{i}")
        if len(text) > s.max_option_chars:
            raise TooLarge(f"option {LETTERS[i]} is {len(text)} characters; the limit is {s.max_option_chars}",
                           f"{prefix}options.{i}")
    if req.context is not None and len(req.context) > s.max_context_chars:
        raise TooLarge(f"context is {len(req.context)} characters; the limit is {s.max_context_chars}",
                       prefix + "context")
    if req.conformal is not None:  # an alpha or score not stored for this option count is the client's error: 422,
        stored_quantile(conformal_of(runtime, len(options)), req, prefix)  # before the model runs
    return MCQuestion(req.question, tuple(options), req.context or None, id=req.id)


def within_tokens(settings: EngineSettings, q: TokenizedQuestion, prefix: str = "") -> int:
    """The prompt's token count, TooLarge past ``max_tokens`` (a served prompt is never shortened)."""
    tokens = len(q.prompt_ids)
    if tokens > settings.max_tokens:
        raise TooLarge(f"the prompt is {tokens} tokens after formatting; the limit is {settings.max_tokens}",
                       prefix + ("context" if q.context else "question"))
    return tokens


def conformal_of(runtime: AdapterRuntime, options: int) -> Conformal | None:
    """The stored quantiles a question with ``options`` options is answered with: its count's own when the
    calibration has them, else the pooled ones; None when the adapter has no conformal calibration. The one
    lookup the request check and the answer share."""
    return None if runtime.conformal is None else runtime.conformal.for_options(options)


def stored_quantile(conformal: Conformal | None, req: PredictRequest,
                    prefix: str = "") -> tuple[float, float, str] | None:
    """(quantile, alpha, score) of the set a request gets, looked up among ``conformal``'s stored quantiles (the
    request's alpha and score, else the calibration's defaults; computing a quantile from scores is
    ibedl.core.conformal.conformal_quantile); None when the adapter has no conformal calibration, InvalidRequest for
    an alpha or score not stored."""
    opts = req.conformal
    if conformal is None:
        if opts is not None and (opts.alpha is not None or opts.score is not None):
            raise InvalidRequest("this adapter has no conformal calibration; run python -m "
                                 "ibedl.training.calibrate on it to get prediction sets", prefix + "conformal")
        return None
    alpha = opts.alpha if opts and opts.alpha is not None else conformal.alpha
    score = opts.score if opts and opts.score is not None else conformal.score
    try:
        if alpha not in conformal.alphas():  # exactly a stored alpha, not one that rounds to it (alpha_key)
            raise KeyError(alpha)
        return conformal.quantile(alpha, score), alpha, score
    except (KeyError, ValueError):
        raise InvalidRequest(f"no stored prediction set for alpha {alpha} and score {score!r}; "
                             f"stored alphas: {conformal.alphas()}, scores: {sorted(conformal.quantiles)}",
                             prefix + "conformal") from None


def tokenized(runtime: AdapterRuntime, questions: list[MCQuestion]) -> list[TokenizedQuestion]:
    """``questions`` (one request's, for the adapter ``runtime``) with their formatted prompts' token ids, tokenised
    in one call on the calling thread's own copy of the runtime's tokenizer: a pass on the runtime's predictor takes
    them (the tokenizer they were copied from is its own)."""
    counter, template = runtime.count_tokenizers, runtime.predictor.template
    return [TokenizedQuestion.of(q, counter.source, template, ids)
            for q, ids in zip(questions, prompts_ids(counter.get(), template, questions), strict=True)]
