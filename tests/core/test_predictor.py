import copy
import dataclasses

import pytest
import torch

from ibedl.core.base_model import load_base_model, resolve_model
from ibedl.core.head import HeadConfig, HeadPrediction, build_head
from ibedl.core.predictor import (
    Predictor,
    PromptTooLongError,
    TokenizedQuestion,
    fits,
    lm_head_rows,
    prompt_ids,
    to_predictions,
)
from ibedl.core.prompt import MCQuestion, format_prompt, option_token_ids
from tests.conftest import tokenizer_calls

QUESTIONS = [
    MCQuestion("What do plants need?", ("sunlight", "sand", "salt", "iron")),
    MCQuestion("Which planet is closest to the sun?", ("Mercury", "Venus", "Earth")),
    MCQuestion("Read the passage. What did the boy buy?", ("apples", "bread", "milk", "eggs", "rice"),
               context="The boy went to the market to buy apples and bread for his mother. " * 3),
]


@pytest.fixture(scope="module")
def predictor(tiny_model_dir):
    resolved = resolve_model(tiny_model_dir)
    model, tok = load_base_model(resolved, device="cpu")
    ids = option_token_ids(tok, 26)
    head = build_head(HeadConfig("ib_edl", 26, model.config.hidden_size), lm_head_rows(model, ids))
    return Predictor(model, tok, head, template="plain-v1", max_tokens=256)


def test_last_token_hidden_equals_full_forward(predictor):
    # The option-rows path must equal the LM's own next-token logits at the last real position.
    enc = predictor.encode(QUESTIONS)
    h = predictor.hidden(enc)
    ids = option_token_ids(predictor.tokenizer, 5)
    with torch.no_grad():
        for i in range(len(QUESTIONS)):
            n = int(enc.attention_mask[i].sum())
            full = predictor.model(input_ids=enc.input_ids[i : i + 1, :n]).logits[0, -1, ids]
            torch.testing.assert_close(h[i] @ lm_head_rows(predictor.model, ids).T, full, rtol=1e-4, atol=1e-4)


def test_batch_invariance(predictor):
    together = predictor.predict(QUESTIONS)
    alone = [predictor.predict([q])[0] for q in QUESTIONS]
    for a, b in zip(together, alone, strict=True):
        assert a.letter == b.letter
        assert a.probs == pytest.approx(b.probs, abs=1e-5)
        assert a.uncertainty == pytest.approx(b.uncertainty, abs=1e-5)


def test_prediction_invariants(predictor):
    for q, p in zip(QUESTIONS, predictor.predict(QUESTIONS), strict=True):
        assert p.num_options == q.num_options
        assert sum(p.probs) == pytest.approx(1.0, abs=1e-5)
        assert sum(p.belief) + p.uncertainty == pytest.approx(1.0, abs=1e-5)
        for pj, bj in zip(p.probs, p.belief, strict=True):
            assert pj == pytest.approx(bj + p.uncertainty / q.num_options, abs=1e-6)
        assert p.confidence == max(p.probs)
        assert len(p.sigma) == q.num_options


def test_long_context_is_truncated_or_rejected(tiny_model_dir, predictor):
    q = MCQuestion("What did the boy buy?", ("apples", "bread"), context="word " * 2000)
    short = Predictor(predictor.model, predictor.tokenizer, predictor.heads, "plain-v1", max_tokens=64)
    enc = short.encode([q])
    assert enc.input_ids.shape[1] <= 64
    with pytest.raises(PromptTooLongError, match="the limit is 64"):
        short.encode([q], truncate_context=False)
    assert short.count_tokens(q) > 64


def test_question_too_long_even_without_context(predictor):
    short = Predictor(predictor.model, predictor.tokenizer, predictor.heads, "plain-v1", max_tokens=16)
    with pytest.raises(PromptTooLongError):
        short.encode([MCQuestion("why " * 50, ("a", "b"), context="x")])


def test_fits_agrees_with_encode_at_every_limit(predictor):
    """Training drops questions that do not fit; every one it keeps must encode (no error mid-run)."""
    q = MCQuestion("What did the boy buy?", ("apples", "bread"), context="word " * 40)
    whole = predictor.count_tokens(q)
    for limit in range(8, whole + 2):
        short = Predictor(predictor.model, predictor.tokenizer, predictor.heads, "plain-v1", max_tokens=limit)
        try:
            short.encode([q])
            encodes = True
        except PromptTooLongError:
            encodes = False
        assert fits(predictor.tokenizer, "plain-v1", limit, q) == encodes, limit


def test_length_groups_bound_padding():
    from ibedl.core.predictor import length_groups

    lengths = [100, 12, 95, 10, 300, 11, 98]
    groups = length_groups(lengths, 1.25)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert max(lengths[i] for i in g) * len(g) <= 1.25 * sum(lengths[i] for i in g)
    assert [sorted(g) for g in groups] == [[1, 3, 5], [0, 2, 6], [4]]
    assert length_groups([5, 500], 100.0) == [[0, 1]]
    with pytest.raises(ValueError, match="max_padding must be >= 1, got 0.5"):
        length_groups([1], 0.5)


def test_grouped_predict_equals_one_batch(predictor):
    # QUESTIONS have very different lengths: predict() splits them, forward(encode()) pads them together.
    grouped = predictor.predict(QUESTIONS)
    together = predictor.forward(predictor.encode(QUESTIONS))
    for i, p in enumerate(grouped):
        assert p.probs == pytest.approx(together.probs[i, : len(p.probs)].tolist(), abs=1e-5)


def test_length_grouped_batches_pad_less_and_answer_in_the_callers_order(predictor):
    # Long and short prompts interleaved: predict() runs them in groups of similar length, out of order, and must
    # give each question its own answer, where the caller put it (to float tolerance of one padded batch).
    questions = [QUESTIONS[i % 3] if i % 2 else QUESTIONS[2 - i % 3] for i in range(9)]
    grouped = predictor.predict(questions)
    alone = [predictor.predict([q])[0] for q in questions]
    for g, a in zip(grouped, alone, strict=True):
        assert g.probs == pytest.approx(a.probs, abs=1e-5) and g.uncertainty == pytest.approx(a.uncertainty, abs=1e-5)
    batches = list(predictor.batches(questions))
    assert sorted(i for group, _ in batches for i in group) == list(range(len(questions)))
    assert len(batches) > 1
    padded = sum(int((1 - batch.attention_mask).sum()) for _, batch in batches)
    one_batch = predictor.encode(questions)
    assert padded < int((1 - one_batch.attention_mask).sum())


def counting(predictor, monkeypatch) -> list:
    """Records every trunk pass (Predictor._hidden) of ``predictor``."""
    calls, real = [], predictor._hidden
    monkeypatch.setattr(predictor, "_hidden", lambda batch: calls.append(batch.input_ids.shape[0]) or real(batch))
    return calls


def test_reusing_hidden_runs_each_batch_once_and_changes_no_answer(predictor, monkeypatch):
    calls = counting(predictor, monkeypatch)
    plain = predictor.predict(QUESTIONS)
    assert sum(calls) == len(QUESTIONS)
    calls.clear()
    with predictor.reusing_hidden():
        first = predictor.predict(QUESTIONS)
        assert sum(calls) == len(QUESTIONS)
        second = predictor.predict(QUESTIONS)
        assert sum(calls) == len(QUESTIONS)  # the second pass read the memo
        with pytest.raises(RuntimeError, match="already active"), predictor.reusing_hidden():
            pass
    for a, b, c in zip(plain, first, second, strict=True):
        assert a.probs == b.probs == c.probs and a.sigma == b.sigma == c.sigma
    predictor.predict(QUESTIONS)
    assert sum(calls) == 2 * len(QUESTIONS)  # outside the block every pass runs again


def test_reusing_hidden_does_not_serve_passes_that_are_not_deterministic(predictor, monkeypatch):
    calls = counting(predictor, monkeypatch)
    enc = predictor.encode(QUESTIONS[:2])
    with predictor.reusing_hidden():
        predictor.hidden(enc)  # gradient on: each call runs
        predictor.hidden(enc)
        assert len(calls) == 2
        with torch.no_grad():
            predictor.hidden(enc)
            predictor.hidden(enc)
            assert len(calls) == 3
            predictor.model.train()  # dropout on
            try:
                predictor.hidden(enc)
            finally:
                predictor.model.eval()
            assert len(calls) == 4
            predictor.mc_samples = 3  # MC-Dropout: every sample its own masks
            try:
                predictor.hidden(enc)
            finally:
                predictor.mc_samples = 0
            assert len(calls) == 5


def test_reusing_hidden_keeps_each_adapters_states_apart(predictor, monkeypatch):
    calls = counting(predictor, monkeypatch)
    enc = predictor.encode(QUESTIONS[:2])
    try:
        with torch.no_grad(), predictor.reusing_hidden():
            for adapter in ("member0", "member1", "member0", "member1"):  # an ensemble's members in turn
                predictor.model.active_adapter = adapter
                predictor.hidden(enc)
    finally:
        del predictor.model.active_adapter
    assert len(calls) == 2


def test_a_pass_tokenises_its_prompts_in_one_call_as_one_by_one_would(predictor, monkeypatch):
    """Every prompt's ids as tokenising it alone gives, those past the limit shortened the same way, and one that
    cannot fit refused by its index in the pass."""
    short = Predictor(predictor.model, predictor.tokenizer, predictor.heads, "plain-v1", max_tokens=64)
    long = MCQuestion("What did the boy buy?", ("apples", "bread"), context="word " * 2000)
    questions = [*QUESTIONS, long, QUESTIONS[0]]
    alone = [short._encode_one(i, q, True) for i, q in enumerate(questions)]
    assert len(alone[3]) <= 64 < short.count_tokens(long)  # shortened
    fitting = [format_prompt(q, "plain-v1", short.tokenizer) for q in questions if short.count_tokens(q) <= 64]
    calls = tokenizer_calls(monkeypatch, short.tokenizer)
    assert short._encode_all(questions, True) == alone
    assert isinstance(calls[0], list) and len(calls[0]) == len(questions)  # one call for the pass
    assert len(fitting) == 3 and not set(fitting) & {c for c in calls[1:] if isinstance(c, str)}  # not again alone
    assert short._encode_all([], True) == [] and short.predict([]) == []  # an empty pass, as one by one gave
    batch = short.encode(questions)
    assert [row[:n].tolist() for row, n in zip(batch.input_ids, batch.attention_mask.sum(1), strict=True)] == alone
    fine = MCQuestion("why?", ("a", "b"))
    tight = Predictor(predictor.model, predictor.tokenizer, predictor.heads, "plain-v1",
                      max_tokens=short.count_tokens(fine) + 2)
    with pytest.raises(PromptTooLongError, match="question 1 is") as error:
        tight.encode([fine, MCQuestion("why " * 50, ("a", "b"), context="x")])
    assert error.value.index == 1


def test_a_served_adapter_is_switched_to_only_when_another_is_active(tiny_artifact, tiny_map_artifact, monkeypatch):
    """PEFT's set_adapter walks the whole model: a predictor calls it when the shared model has another adapter
    active, not before every pass, and each adapter answers as when loaded alone."""
    first, second = Predictor.from_artifacts([tiny_artifact, tiny_map_artifact])
    alone = [Predictor.from_artifact(a).predict(QUESTIONS) for a in (tiny_artifact, tiny_map_artifact)]
    switched = []
    original = first.model.set_adapter
    monkeypatch.setattr(first.model, "set_adapter", lambda name: switched.append(name) or original(name))
    answers = {}
    for predictor, name in ((first, "first"), (first, "first"), (second, "second"), (second, "second"),
                            (first, "first")):
        answers.setdefault(name, []).append(predictor.predict(QUESTIONS))
    assert switched == ["a1m0", "m0"]  # loaded with the first active: one switch to the second and one back
    for got, want in ((answers["first"], alone[0]), (answers["second"], alone[1])):
        for run in got:
            for a, b in zip(run, want, strict=True):
                assert a.probs == pytest.approx(b.probs, abs=1e-5)
    assert answers["first"][0][0].probs != pytest.approx(answers["second"][0][0].probs, abs=1e-3)  # two adapters


def test_a_pass_takes_the_ids_a_checked_question_carries_for_its_tokenizer_and_template(predictor, monkeypatch):
    """A question tokenised before its pass (the service's request check, on a copy of the model's tokenizer) carries
    its prompt's ids: the pass takes them and tokenises only the others, in one call, with the answers of tokenising
    them all; ids made for another tokenizer object, another template or texts since replaced are not taken."""
    counter = copy.deepcopy(predictor.tokenizer)  # the check's own copy

    def checked(q, ids_of=None, tokenizer=predictor.tokenizer, template="plain-v1"):
        return TokenizedQuestion.of(q, tokenizer, template, prompt_ids(counter, "plain-v1", ids_of or q))

    plain = predictor._encode_all(QUESTIONS, True)
    mixed = [checked(QUESTIONS[0]), checked(QUESTIONS[1]), QUESTIONS[2]]
    planted = checked(QUESTIONS[0], ids_of=QUESTIONS[1])  # the ids of another prompt: visible if taken
    strangers = [checked(QUESTIONS[0], ids_of=QUESTIONS[1], tokenizer=counter),  # an equal tokenizer, not the one
                 checked(QUESTIONS[0], ids_of=QUESTIONS[1], template="chat-v1"),
                 dataclasses.replace(planted, options=("sunlight", "sand"))]
    calls = tokenizer_calls(monkeypatch, predictor.tokenizer)
    assert predictor._encode_all(mixed, True) == plain
    assert calls == [[format_prompt(QUESTIONS[2], "plain-v1", predictor.tokenizer)]]  # only the plain one, once
    calls.clear()
    assert predictor._encode_all(mixed[:2], True) == plain[:2] and calls == []  # a pass of checked ones: none
    assert predictor._encode_all([planted], True) == [plain[1]]  # taken as carried
    replaced = MCQuestion("What do plants need?", ("sunlight", "sand"))
    assert predictor._encode_all(strangers, True) == [plain[0], plain[0], predictor._encode_all([replaced], True)[0]]
    assert predictor._encode_all([copy.copy(planted), copy.deepcopy(planted)], True) == [plain[1]] * 2  # copies too
    assert copy.copy(predictor)._encode_all([planted], True) == [plain[1]]  # a backend switch's copy of the predictor
    assert "prompt_ids" not in repr(planted) and planted == checked(QUESTIONS[0])  # equal whatever its ids
    assert set(dataclasses.asdict(planted)) == {f.name for f in dataclasses.fields(MCQuestion)} | {"prompt_ids",
                                                                                                     "template"}
    monkeypatch.undo()
    for a, b in zip(predictor.predict(mixed), predictor.predict(QUESTIONS), strict=True):
        assert a.probs == pytest.approx(b.probs, abs=1e-6) and a.uncertainty == pytest.approx(b.uncertainty, abs=1e-6)
    short = Predictor(predictor.model, predictor.tokenizer, predictor.heads, "plain-v1", max_tokens=64)
    long = MCQuestion("What did the boy buy?", ("apples", "bread"), context="word " * 2000)
    assert short._encode_all([checked(long)], True) == [short._encode_one(0, long, True)]  # shortened alike
    with pytest.raises(PromptTooLongError, match="question 0 is"):
        short._encode_all([checked(long)], False)
    with pytest.raises(ValueError, match="a tokenized question needs its prompt's token ids, got none"):
        TokenizedQuestion.of(QUESTIONS[0], predictor.tokenizer, "plain-v1", [])


def test_predictions_split_a_batch_row_by_row_over_each_questions_own_options():
    """Each question's record holds its own options' values as floats of the float32 outputs, its index the first
    largest of them (options past its count never win, a NaN row points at its first NaN as torch's argmax does);
    a head without Dirichlet outputs leaves them None."""
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(4, 5, generator=g)
    probs[1, 3:] = 9.0  # past question 1's 3 options: must not win
    probs[2, :2] = 0.5  # a tie: the first
    probs[3, 1] = float("nan")
    probs[2, 3] = float("nan")  # past question 2's 2 options: ignored
    out = HeadPrediction(logits=probs, probs=probs, alpha=torch.rand(4, 5, generator=g) + 1,
                         belief=torch.rand(4, 5, generator=g), uncertainty=torch.rand(4, generator=g),
                         sigma=torch.rand(4, 5, generator=g))
    counts = [5, 3, 2, 4]
    preds = to_predictions(out, counts)
    for i, (pred, n) in enumerate(zip(preds, counts, strict=True)):
        row = probs[i, :n]
        assert pred.index == int(row.argmax()) and pred.letter == "ABCDE"[pred.index]
        torch.testing.assert_close(torch.tensor(pred.probs, dtype=torch.float64), row.double(), rtol=0, atol=0,
                                   equal_nan=True)  # exactly the float32 values
        assert all(type(x) is float for x in pred.probs) and pred.num_options == n
        assert pred.alpha == [float(x) for x in out.alpha[i, :n]]
        assert pred.belief == [float(x) for x in out.belief[i, :n]]
        assert pred.sigma == [float(x) for x in out.sigma[i, :n]] and pred.uncertainty == float(out.uncertainty[i])
    assert [p.index for p in preds[1:3]] == [int(probs[1, :3].argmax()), 0] and preds[3].index == 1
    assert preds[0].confidence == float(probs[0].max())
    bare = to_predictions(HeadPrediction(logits=probs, probs=probs), counts)
    assert all(p.alpha is None and p.belief is None and p.sigma is None and p.uncertainty is None for p in bare)
    assert [p.probs for p in bare[:3]] == [p.probs for p in preds[:3]]


def test_a_batch_is_padded_on_the_right_and_read_at_its_last_real_token(predictor):
    batch = predictor.encode(QUESTIONS)
    seqs = predictor._encode_all(QUESTIONS, True)
    width = max(len(s) for s in seqs)
    assert batch.input_ids.shape == batch.attention_mask.shape == (3, width) and batch.input_ids.dtype == torch.long
    for i, s in enumerate(seqs):
        assert batch.input_ids[i].tolist() == s + [predictor.tokenizer.pad_token_id] * (width - len(s))
        assert batch.attention_mask[i].tolist() == [1] * len(s) + [0] * (width - len(s))
        assert batch.attention_mask.dtype == batch.last_index.dtype == torch.long
        assert int(batch.last_index[i]) == len(s) - 1
    assert batch.option_mask.tolist() == [[True] * 4 + [False], [True] * 3 + [False] * 2, [True] * 5]
