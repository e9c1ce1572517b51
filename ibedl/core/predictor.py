"""Base model + adapter + head -> predictions. The one path used by training, evaluation and serving.

Only the hidden state of each prompt's last real token is taken from the trunk, and only the C option
rows of the head are applied to it: full-vocabulary logits (B x S x V) are never formed. Prompts are
right-padded and gathered at the last attention-mask position, so a question's answer does not depend
on the other questions of its batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ibedl.core.artifact import Manifest, check_artifact, load_head
from ibedl.core.base_model import decoder_of
from ibedl.core.head import HeadPrediction, OptionHead
from ibedl.core.prompt import LETTERS, MCQuestion, format_prompt, option_token_ids

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 512
MC_SEED = 20250101  # MC-Dropout's dropout masks are drawn from this seed on every call


class PromptTooLongError(ValueError):
    """A formatted prompt longer than the token limit (and no context that could be shortened)."""

    def __init__(self, index: int, num_tokens: int, limit: int) -> None:
        super().__init__(f"question {index} is {num_tokens} tokens after prompt formatting; the limit is {limit}")
        self.index, self.num_tokens, self.limit = index, num_tokens, limit


class BaseModelMismatchError(ValueError):
    """The adapter was trained on other base weights than the ones loaded."""


@dataclass
class EncodedBatch:
    """Tokenised prompts of a batch.

    Attributes:
        input_ids: (B, S) right-padded token ids.
        attention_mask: (B, S).
        last_index: (B,) position of each prompt's last real token.
        option_mask: (B, C) True for the real options of each question, C = max options in the batch.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    last_index: torch.Tensor
    option_mask: torch.Tensor

    def to(self, device) -> EncodedBatch:
        return EncodedBatch(*(t.to(device)
                              for t in (self.input_ids, self.attention_mask, self.last_index, self.option_mask)))


@dataclass
class Prediction:
    """One question's answer and its uncertainty, as plain Python values."""

    index: int
    letter: str
    confidence: float
    probs: list[float]
    alpha: list[float] | None
    belief: list[float] | None
    uncertainty: float | None
    sigma: list[float] | None

    @property
    def num_options(self) -> int:
        return len(self.probs)


def _as_lists(t: torch.Tensor | None) -> list | None:
    """``t`` as nested Python floats, in one call (not an element at a time: a pass of 64 answers spent milliseconds
    on that)."""
    return None if t is None else t.detach().float().cpu().tolist()


def to_predictions(out: HeadPrediction, num_options: list[int]) -> list[Prediction]:
    """Split a batch's head outputs into per-question :class:`Prediction` records."""
    probs = out.probs.detach().float().cpu()
    real = torch.arange(probs.shape[1]) < torch.tensor(num_options)[:, None]  # (B, C): each question's own options
    index = probs.masked_fill(~real, float("-inf")).argmax(1).tolist()  # as p[:n].argmax() of each row
    rows, alpha, belief, sigma = (_as_lists(t) for t in (probs, out.alpha, out.belief, out.sigma))
    u = _as_lists(out.uncertainty)
    return [Prediction(index=idx, letter=LETTERS[idx], confidence=rows[i][idx], probs=rows[i][:n],
                       alpha=None if alpha is None else alpha[i][:n], belief=None if belief is None else belief[i][:n],
                       uncertainty=None if u is None else u[i], sigma=None if sigma is None else sigma[i][:n])
            for i, (n, idx) in enumerate(zip(num_options, index, strict=True))]


def length_groups(lengths: list[int], max_padding: float = 1.25) -> list[list[int]]:
    """Indices grouped by length so that each group's padded size (longest x count) stays within
    ``max_padding`` times its real tokens. Groups come shortest first; indices within a group ascend by length."""
    if max_padding < 1:
        raise ValueError(f"max_padding must be >= 1, got {max_padding}")
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if current and lengths[i] * (len(current) + 1) > max_padding * (real + lengths[i]):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += lengths[i]
    if current:
        groups.append(current)
    return groups


def prompt_ids(tokenizer, template: str, q: MCQuestion) -> list[int]:
    """Token ids of the formatted prompt of ``q`` (with its whole passage)."""
    return tokenizer(format_prompt(q, template, tokenizer))["input_ids"]


def prompts_ids(tokenizer, template: str, questions: list[MCQuestion]) -> list[list[int]]:
    """:func:`prompt_ids` of each of ``questions``, tokenised in one call (a fast tokenizer's batch: the same ids in
    less time than a call each, tests/integration/test_prompt_tokens_real.py)."""
    if not questions:  # a fast tokenizer refuses an empty list
        return []
    return tokenizer([format_prompt(q, template, tokenizer) for q in questions])["input_ids"]


def count_prompt_tokens(tokenizer, template: str, q: MCQuestion) -> int:
    """Tokens of the formatted prompt of ``q`` (with its whole passage)."""
    return len(prompt_ids(tokenizer, template, q))


@dataclass(frozen=True)
class TokenizedQuestion(MCQuestion):
    """A question whose whole prompt was tokenised before its pass (the service counts every prompt's tokens when it
    checks the request, on one of its check threads): ``prompt_ids`` under ``template`` by a copy of the tokenizer
    :meth:`of` was given. A predictor whose tokenizer is that very object and whose template is ``template`` takes
    the ids instead of tokenising the prompt again on the model's thread; any other predictor tokenises it as a plain
    question, and so does every predictor for a question made otherwise than by :meth:`of` (``dataclasses.replace``
    with other texts included: the tokenizer is no field, only a weak reference :meth:`of` attaches). Compares equal
    to a tokenized question of the same fields whatever its ids.

    Attributes:
        prompt_ids: the formatted prompt's token ids, untruncated (:func:`prompt_ids`).
        template: the prompt template they were made under.
    """

    prompt_ids: tuple[int, ...] = dataclasses.field(default=(), compare=False, repr=False)
    template: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.prompt_ids:
            raise ValueError("a tokenized question needs its prompt's token ids, got none")
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))

    @classmethod
    def of(cls, q: MCQuestion, tokenizer, template: str, ids: list[int]) -> TokenizedQuestion:
        """``q`` with the ids of its prompt under ``template``, made by ``tokenizer`` or a copy of it."""
        fields = {f.name: getattr(q, f.name) for f in dataclasses.fields(MCQuestion)}
        made = cls(**fields, prompt_ids=ids, template=template)
        object.__setattr__(made, "_made_by", weakref.ref(tokenizer))  # a copy or deepcopy keeps the reference
        return made

    def made_by(self, tokenizer) -> bool:
        """Whether the ids were made by ``tokenizer`` (or a copy of it) for these very texts."""
        made_by = getattr(self, "_made_by", None)
        return made_by is not None and made_by() is tokenizer


def fits(tokenizer, template: str, max_tokens: int, q: MCQuestion) -> bool:
    """Whether ``q`` fits ``max_tokens`` once its passage (if any) is shortened as far as needed."""
    if count_prompt_tokens(tokenizer, template, q) <= max_tokens:
        return True
    if not q.context:
        return False
    # The same arithmetic as Predictor._encode_one: the prompt with an empty passage, plus 2 spare tokens.
    bare = len(tokenizer(format_prompt(q, template, tokenizer, context=""))["input_ids"])
    return bare <= max_tokens - 2


def lm_head_rows(model, token_ids: list[int]) -> torch.Tensor:
    """The LM head's rows of ``token_ids``: (len(token_ids), d), float32, detached."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weight = base.get_output_embeddings().weight
    return weight[torch.tensor(token_ids, device=weight.device)].detach().float().cpu().clone()


class Predictor:
    """Turns batches of :class:`MCQuestion` into head outputs and :class:`Prediction` records.

    Args:
        model: causal LM, usually a PEFT model carrying the adapter(s).
        tokenizer: its tokenizer.
        heads: one head per ensemble member (one for a single adapter).
        template: prompt template name.
        max_tokens: token limit of a formatted prompt.
        members: PEFT adapter names, parallel to ``heads`` (None: use the model as it is).
        mc_samples: > 0 averages that many dropout-on passes (MC-Dropout).
        max_padding: ``predict`` splits a batch into groups of similar length whose padded size stays
            within this factor of their real tokens.
    """

    def __init__(
        self,
        model,
        tokenizer,
        heads: list[OptionHead] | OptionHead,
        template: str,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        members: list[str] | None = None,
        mc_samples: int = 0,
        manifest: Manifest | None = None,
        max_padding: float = 1.25,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.heads = heads if isinstance(heads, list) else [heads]
        self.template = template
        self.max_tokens = max_tokens
        self.members = members
        self.mc_samples = mc_samples
        self.manifest = manifest
        self.max_padding = max_padding
        if members is not None and len(members) != len(self.heads):
            raise ValueError(f"{len(members)} adapter members for {len(self.heads)} heads")
        if max_tokens < 8:
            raise ValueError(f"max_tokens must be >= 8, got {max_tokens}")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.decoder = decoder_of(model)
        self.trunk = None  # an inference backend's trunk (ibedl.core.backends); None: the model's own forward
        self.backend = "torch"  # the inference backend's name (serve_on sets it)
        self.backend_reason = "named"  # why that backend (what ``auto`` weighed)
        self.backend_choice = None  # what ``auto`` measured (ibedl.core.auto_backend.AutoChoice), None: not auto
        self.quantized_on = None  # static int8: sha256 of the quantisation sample file its trunk was quantised on
        self.calibration = None  # the manifest's calibration for this backend (use_calibration), None: none matches
        # (device, dtype, loaded in 4 bits) once the model is dropped: what a torch calibration key is made of
        self._released: tuple[torch.device, torch.dtype, bool] | None = None
        self.num_rows = self.heads[0].config.num_rows
        self._hidden_memo: dict | None = None  # reusing_hidden's states by batch, None: outside the block
        format_prompt(MCQuestion("probe", ("a", "b")), template, tokenizer)  # fails early on a bad template

    @property
    def head(self) -> OptionHead:
        return self.heads[0]

    @property
    def device(self) -> torch.device:
        if self._released is not None:
            return self._released[0]
        return next(self.model.parameters()).device

    @property
    def calibration_key(self) -> str:
        """The backend and precision this predictor computes in, as calibrations are keyed
        (ibedl.core.backends.calibration_key): ``torch-fp32``, ``openvino-bf16``, ..."""
        return self.calibration_key_on(self.backend)

    def calibration_key_on(self, backend: str) -> str:
        """The calibration key of this predictor's weights run on the concrete ``backend``: its device, dtype and
        4-bit loading for those whose key names them (torch), the model's as loaded when it has been dropped."""
        from ibedl.core.backends import calibration_key

        return calibration_key(backend, *self._arithmetic())

    def _arithmetic(self) -> tuple[torch.device, torch.dtype, bool]:
        """(device, dtype, loaded in 4 bits) of the torch model, or of the one dropped (:meth:`drop_model`)."""
        if self.model is None:
            return self._released
        dtype = getattr(self.model, "dtype", None) or next(self.model.parameters()).dtype
        return self.device, dtype, bool(getattr(self.model, "is_loaded_in_4bit", False))

    def record_choice(self, choice) -> None:
        """What ``auto`` measured in the background (ibedl.core.auto_backend.AutoChoice), once it is done."""
        self.backend_choice = choice

    def serve_on(self, built) -> None:
        """Answer with a built backend from now on (``ibedl.core.backends.Built``: its trunk, name, why, what ``auto``
        measured and the sample a static int8 trunk was quantised on); the calibration is looked up again
        (:meth:`use_calibration`). The one place a backend is set on a predictor."""
        if built.trunk is None and self.model is None:
            raise ValueError(f"this predictor released its torch model: it cannot serve on {built.backend}")
        self.trunk, self.backend, self.backend_reason = built.trunk, built.backend, built.reason
        self.backend_choice, self.quantized_on = built.choice, built.quantized_on
        self.calibration = None

    def use_calibration(self) -> None:
        """Look up the manifest's calibration made on this predictor's backend and precision
        (:attr:`calibration`, None when it carries none) and set the heads' post-hoc parameter to its value."""
        self.calibration = None if self.manifest is None else self.manifest.calibration_for(self.calibration_key)
        if self.calibration is None:
            return
        for head in self.heads:
            for key, value in self.calibration.head.items():
                setattr(head.config, key, value)

    def release_model(self) -> None:
        """Drop the torch model once a backend's trunk answers without it (one adapter, no MC-Dropout): a served
        OpenVINO model does not hold the torch weights beside its own. The heads and tokenizer stay."""
        if self.trunk is None:
            raise ValueError("release_model needs a backend trunk (the torch backend answers with the model)")
        self.drop_model()

    def drop_model(self) -> None:
        """Drop the torch model whatever answers (a copy that only encodes, such as the background switcher's),
        keeping the device, dtype and 4-bit loading its calibration key is made of; :meth:`release_model` is the
        checked call for a server."""
        from ibedl.core.memory_limit import collect_garbage

        self._released = self._arithmetic()
        self.model = self.decoder = None
        collect_garbage()

    # -- tokenisation ---------------------------------------------------------------------------

    def _encode_all(self, questions: list[MCQuestion], truncate_context: bool) -> list[list[int]]:
        """Token ids of each question's prompt: those a :class:`TokenizedQuestion` carries for this tokenizer and
        template, the others tokenised in one call (the fast tokenizer's batch, a pass's questions at once), a prompt
        past ``max_tokens`` then shortened by :meth:`_encode_one`."""
        seqs = [self._tokenized_ids(q) for q in questions]
        fresh = [i for i, ids in enumerate(seqs) if ids is None]
        for i, ids in zip(fresh, prompts_ids(self.tokenizer, self.template, [questions[i] for i in fresh]),
                          strict=True):
            seqs[i] = ids
        return [ids if len(ids) <= self.max_tokens else self._encode_one(i, q, truncate_context, ids)
                for i, (q, ids) in enumerate(zip(questions, seqs, strict=True))]

    def _tokenized_ids(self, q: MCQuestion) -> list[int] | None:
        """The ids ``q`` carries, when they were made by this predictor's tokenizer under its template."""
        if isinstance(q, TokenizedQuestion) and q.made_by(self.tokenizer) and q.template == self.template:
            return list(q.prompt_ids)
        return None

    def _encode_one(self, index: int, q: MCQuestion, truncate_context: bool,
                    ids: list[int] | None = None) -> list[int]:
        """Token ids of ``q``'s prompt (``ids``: already tokenised whole), its passage's tail cut to fit
        ``max_tokens`` where ``truncate_context`` allows; PromptTooLongError naming ``index`` where it cannot fit."""
        if ids is None:
            ids = prompt_ids(self.tokenizer, self.template, q)
        if len(ids) <= self.max_tokens:
            return ids
        if not (truncate_context and q.context):
            raise PromptTooLongError(index, len(ids), self.max_tokens)
        # Keep the question and options whole; cut the passage's tail to fit.
        bare = len(self.tokenizer(format_prompt(q, self.template, self.tokenizer, context=""))["input_ids"])
        budget = self.max_tokens - bare - 2
        if budget < 0:
            raise PromptTooLongError(index, bare, self.max_tokens)
        ctx_ids = self.tokenizer(q.context, add_special_tokens=False)["input_ids"]
        for keep in (budget, budget - 8, budget - 32):
            context = self.tokenizer.decode(ctx_ids[: max(keep, 0)])
            ids = self.tokenizer(format_prompt(q, self.template, self.tokenizer, context=context))["input_ids"]
            if len(ids) <= self.max_tokens:
                return ids
        raise PromptTooLongError(index, len(ids), self.max_tokens)

    def count_tokens(self, q: MCQuestion) -> int:
        """Tokens of the formatted prompt of ``q``, untruncated."""
        return count_prompt_tokens(self.tokenizer, self.template, q)

    def encode(self, questions: list[MCQuestion], truncate_context: bool = True) -> EncodedBatch:
        """Tokenise and right-pad a batch. Raises :class:`PromptTooLongError` past ``max_tokens``."""
        if not questions:
            raise ValueError("encode needs at least one question")
        return self._pad(self._encode_all(questions, truncate_context), questions)

    def _pad(self, seqs: list[list[int]], questions: list[MCQuestion]) -> EncodedBatch:
        lengths = [len(s) for s in seqs]
        width = max(lengths)
        pad = self.tokenizer.pad_token_id
        # one tensor from padded lists, not one a row: a pass of 64 spent milliseconds on torch.tensor calls
        input_ids = torch.tensor([list(s) + [pad] * (width - len(s)) for s in seqs], dtype=torch.long)
        attention = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
        num_options = max(q.num_options for q in questions)
        if num_options > self.num_rows:
            raise ValueError(f"the head scores at most {self.num_rows} options, got {num_options}")
        option_mask = torch.zeros((len(seqs), num_options), dtype=torch.bool)
        for i, q in enumerate(questions):
            option_mask[i, : q.num_options] = True
        last = torch.tensor([len(s) - 1 for s in seqs])
        return EncodedBatch(input_ids, attention, last, option_mask)

    # -- forward --------------------------------------------------------------------------------

    def hidden(self, batch: EncodedBatch) -> torch.Tensor:
        """(B, d) hidden state of each prompt's last real token (after the final norm)."""
        memo = self._hidden_memo
        if memo is None or torch.is_grad_enabled() or self.mc_samples > 0 or (self.model is not None
                                                                             and self.model.training):
            return self._hidden(batch)
        digest = hashlib.blake2b(digest_size=16)
        for t in (batch.input_ids, batch.attention_mask, batch.last_index):
            digest.update(str(tuple(t.shape)).encode())
            digest.update(t.detach().cpu().numpy().tobytes())
        key = (id(self.trunk), str(getattr(self.model, "active_adapter", None)), digest.hexdigest())
        if key not in memo:
            memo[key] = self._hidden(batch)
        return memo[key]

    @contextlib.contextmanager
    def reusing_hidden(self):
        """Inside the block, :meth:`hidden` answers a batch it already ran (same token ids and mask, same active
        adapter, same trunk) from memory while the pass is deterministic: no gradient, no MC-Dropout, the model in
        eval mode.
        Evaluation runs the same batches (:meth:`batches`) for the predictions, the OOD features and a post-hoc
        step's undone predictions, so one trunk pass serves all three. The trunk's weights must not change inside
        the block (the heads may: the memo holds the states they read)."""
        if self._hidden_memo is not None:
            raise RuntimeError("reusing_hidden is already active on this predictor")
        self._hidden_memo = {}
        try:
            yield self
        finally:
            self._hidden_memo = None

    def _hidden(self, batch: EncodedBatch) -> torch.Tensor:
        if self.trunk is not None:
            return self.trunk(batch)
        batch = batch.to(self.device)
        out = self.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        states = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return states[torch.arange(states.shape[0], device=states.device), batch.last_index]

    def activate(self, name: str) -> None:
        """Make PEFT adapter ``name`` the active one, unless it already is: ``set_adapter`` walks every module of the
        model (11-17 ms a call on the 2-core EPYC, once a pass when it was called every pass;
        benchmarks.pass_overhead). Whoever else shares the model (another adapter served beside it, an ensemble's
        members) is seen by its ``active_adapter``."""
        if getattr(self.model, "active_adapter", None) not in (name, [name]):
            self.model.set_adapter(name)

    def _member_forward(self, batch: EncodedBatch, k: int) -> HeadPrediction:
        if self.members is not None and hasattr(self.model, "set_adapter"):
            self.activate(self.members[k])
        head = self.heads[k]
        mask = batch.option_mask.to(self.device)
        if self.mc_samples <= 0:
            return head(self.hidden(batch), mask)
        # Fixed dropout masks per call: the same batch always gets the same answer (a request alone in
        # its batch is deterministic; under micro-batching its masks depend on its batch position).
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(MC_SEED + k)
            runs = [head(self.hidden(batch), mask) for _ in range(self.mc_samples)]
        return _average(runs)

    def forward(self, batch: EncodedBatch) -> HeadPrediction:
        """Head outputs for an encoded batch; ensembles average member probabilities, then the head's
        post-hoc temperature (softmax methods) applies to the predictive probabilities."""
        outs = [self._member_forward(batch, k) for k in range(len(self.heads))]
        out = outs[0] if len(outs) == 1 else _average(outs)
        if out.alpha is None:
            out.probs = self.head.config.posthoc_probs(out.probs, batch.option_mask.to(out.probs.device))
        return out

    @torch.no_grad()
    def predict(self, questions: list[MCQuestion], truncate_context: bool = True) -> list[Prediction]:
        """Predictions in input order. The questions run in sub-batches of similar prompt length:
        padding is computed like real tokens, and on a CPU a batch padded to its longest prompt can be
        slower than its questions one by one."""
        out: list[Prediction | None] = [None] * len(questions)
        for group, batch in self.batches(questions, truncate_context):
            preds = to_predictions(self.forward(batch), [questions[i].num_options for i in group])
            for i, pred in zip(group, preds, strict=True):
                out[i] = pred
        return out  # type: ignore[return-value]

    def batches(self, questions: list[MCQuestion], truncate_context: bool = True):
        """Yields (indices into ``questions``, EncodedBatch) for groups of similar prompt length
        (:func:`length_groups`): the batches :meth:`predict` runs."""
        seqs = self._encode_all(questions, truncate_context)
        for group in length_groups([len(s) for s in seqs], self.max_padding):
            yield group, self._pad([seqs[i] for i in group], [questions[i] for i in group])

    def eval(self) -> Predictor:
        """Inference mode; MC-Dropout keeps its LoRA dropout layers active."""
        if self.model is None:  # released: the backend's trunk answers
            for head in self.heads:
                head.eval()
            return self
        self.model.eval()
        for head in self.heads:
            head.eval()
        if self.mc_samples > 0:
            for module in self.model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.train()
        return self

    # -- loading --------------------------------------------------------------------------------

    @classmethod
    def from_artifact(
        cls,
        directory: str | Path,
        base_model: str | None = None,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        load_in_4bit: bool = False,
        allow_base_mismatch: bool = False,
        backend: str = "torch",
        resolved=None,
        tokenizer=None,
    ) -> Predictor:
        """Load base model + adapter(s) + head(s) of an artifact directory.

        Args:
            directory: the artifact.
            base_model: a model reference overriding the manifest's base model name.
            allow_base_mismatch: load even when the base weights' sha256 differs from the manifest's.
            backend: inference backend of the trunk (:mod:`ibedl.core.backends`); ``auto`` picks one.
            resolved, tokenizer: see :meth:`from_artifacts`.
        """
        (predictor,) = cls.from_artifacts([directory], base_model, device, dtype, load_in_4bit, allow_base_mismatch,
                                          backend, resolved=resolved, tokenizer=tokenizer)
        return predictor

    @classmethod
    def from_artifacts(
        cls,
        directories: list[str | Path],
        base_model: str | None = None,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        load_in_4bit: bool = False,
        allow_base_mismatch: bool = False,
        backend: str = "torch",
        resolved=None,
        tokenizer=None,
    ) -> list[Predictor]:
        """Several artifacts on one base model, loaded once (PEFT multi-adapter): the adapters of artifact j are
        added to the shared model as ``a{j}m{i}`` (``m{i}`` for the first), and each predictor switches the model
        to its own before each forward pass (:meth:`_member_forward`). So the predictors share the trunk's
        weights and must not run forward passes concurrently (the service runs them on one thread).

        ``resolved`` (an :class:`ibedl.core.base_model.ResolvedModel`) is the base model when the caller already
        resolved it (training: once per process), instead of resolving ``base_model`` or the manifest's reference
        again; ``tokenizer`` its tokenizer, when already loaded. ``openvino-int8`` quantises the trunk on the
        artifact's quantisation sample (ibedl.core.quantization_sample; once per adapter, then cached).

        Refused with :class:`BaseModelMismatchError` when the artifacts were trained on different base weights
        (one process holds one base model), and with ``ValueError`` for more than one artifact on a backend
        other than torch or with an MC-Dropout artifact (its dropout stays active in the shared model).
        """
        from ibedl.core.auto_backend import build as build_trunk
        from ibedl.core.backends import REFERENCE, check_backend
        from ibedl.core.base_model import load_base_model, resolve_model

        check_backend(backend)
        directories = [Path(d) for d in directories]
        if not directories:
            raise ValueError("from_artifacts needs at least one artifact directory")
        manifests = [check_artifact(d, verify=True) for d in directories]
        first, base = directories[0], manifests[0].base_model_ref()
        reason = None
        if len(directories) > 1 and backend == "auto":
            backend, reason = REFERENCE, f"several adapters share one {REFERENCE} base model"
            log.info("inference backend auto -> %s (%s)", backend, reason)
        if len(directories) > 1:
            _check_served_together(directories, manifests, backend)
        if resolved is None:
            resolved = resolve_model(base_model or base.ref)
        if resolved.sha256 != base.sha256 and not allow_base_mismatch:
            raise BaseModelMismatchError(
                f"adapter {first} was trained on {base.name} "
                f"(sha256 {base.sha256[:12]}), but {resolved.name} has sha256 "
                f"{resolved.sha256[:12]}"
            )
        model, tokenizer = load_base_model(resolved, device=device, dtype=dtype, load_in_4bit=load_in_4bit,
                                           tokenizer=tokenizer)
        model, loaded = _load_adapters(model, tokenizer, directories, manifests)
        model.eval()
        predictors = []
        for directory, manifest, names in zip(directories, manifests, loaded, strict=True):
            prompt = manifest.prompt_config()
            heads = [load_head(directory / member, manifest).to(model.device) for member in manifest.members]
            predictor = cls(
                model,
                tokenizer,
                heads,
                template=prompt.template,
                max_tokens=DEFAULT_MAX_TOKENS if prompt.max_tokens is None else prompt.max_tokens,
                members=names,
                mc_samples=manifest.mc_samples,
                manifest=manifest,
            )
            built = build_trunk(backend, predictor, directory, resolved.sha256)
            predictor.serve_on(dataclasses.replace(built, reason=reason) if reason is not None else built)
            predictor.use_calibration()
            predictors.append(predictor.eval())
        if len(predictors) > 1:
            predictors[0].model.set_adapter(predictors[0].members[0])
        return predictors


def _check_served_together(directories: list[Path], manifests: list[Manifest], backend: str) -> None:
    """Several adapters share one torch base model: refused (naming the adapter) for another backend, another base
    model's weights, or MC-Dropout (its dropout would stay on in the shared model)."""
    from ibedl.core.backends import REFERENCE

    if backend != REFERENCE:
        raise ValueError(f"several adapters share one {REFERENCE} base model; backend {backend!r} builds one trunk "
                         f"per adapter: serve them with backend {REFERENCE}")
    first, base = directories[0], manifests[0].base_model_ref()
    for d, m in zip(directories, manifests, strict=True):
        other = m.base_model_ref()
        if other.sha256 != base.sha256:
            raise BaseModelMismatchError(
                f"adapter {d} was trained on {other.name} (sha256 {other.sha256[:12]}) but adapter {first} on "
                f"{base.name} (sha256 {base.sha256[:12]}); adapters served together share one base model: "
                "serve them from separate services")
        if m.mc_samples > 0:
            raise ValueError(f"adapter {d} uses MC-Dropout, whose dropout stays on in the shared base model; "
                             "serve it alone")


def _load_adapters(model, tokenizer, directories: list[Path], manifests: list[Manifest]) -> tuple[object, list]:
    """(the PEFT model with every member of every artifact loaded, each artifact's adapter names): artifact j's
    members are ``a{j}m{i}`` (``m{i}`` for the first). BaseModelMismatchError when an artifact's option token ids
    are not this tokenizer's."""
    from peft import PeftModel

    loaded = []
    for j, (directory, manifest) in enumerate(zip(directories, manifests, strict=True)):
        ids = option_token_ids(tokenizer, manifest.head_config().num_rows)
        if ids != manifest.option_token_ids:
            raise BaseModelMismatchError(f"option token ids {ids} of adapter {directory} differ from its "
                                         f"manifest's {manifest.option_token_ids}")
        names = [f"{f'a{j}' if j else ''}m{i}" for i in range(len(manifest.members))]
        for name, member in zip(names, manifest.members, strict=True):
            if not isinstance(model, PeftModel):
                model = PeftModel.from_pretrained(model, directory / member, adapter_name=name, use_safetensors=True)
            else:
                model.load_adapter(directory / member, adapter_name=name, use_safetensors=True)
        loaded.append(names)
    return model, loaded


def _average(outs: list[HeadPrediction]) -> HeadPrediction:
    """Mean of probabilities (and of the Dirichlet quantities, when every member has them)."""

    def mean(name: str):
        values = [getattr(o, name) for o in outs]
        return None if any(v is None for v in values) else torch.stack(values).mean(0)

    return HeadPrediction(
        probs=mean("probs"),
        logits=mean("logits"),
        alpha=mean("alpha"),
        belief=mean("belief"),
        uncertainty=mean("uncertainty"),
        sigma=mean("sigma"),
    )


__all__ = ["Predictor", "Prediction", "EncodedBatch", "PromptTooLongError", "BaseModelMismatchError",
           "TokenizedQuestion", "prompt_ids", "prompts_ids", "count_prompt_tokens"]
