"""Receipts (signed, checked, expiring), the feedback store (once per receipt, shared by two connections; a
receipt keeps its first label; a credential's quota counted across connections; a store of the previous version
gains its new column, another version's file is refused) and the adaptive sets' threshold (its long-run miscoverage
bound on any sequence)."""

from __future__ import annotations

import dataclasses
import sqlite3

import numpy as np
import pytest

from ibedl.core.conformal import prediction_set
from ibedl.engine.adaptive import SCORE_BOUND, QuantileTracker
from ibedl.engine.errors import InvalidReceipt, ReceiptExpired, TooLarge, TooManyLabels
from ibedl.engine.feedback_sqlite import SCHEMA
from ibedl.engine.feedback_sqlite import SqliteStore as FeedbackStore
from ibedl.engine.feedback_store import COLUMNS, LabelQuota
from ibedl.engine.receipts import Receipt, new_id, sign, verify

KEY = b"k" * 32


def receipt(**changes) -> Receipt:
    base = Receipt(id=new_id(), question="q-1", adapter="default", version="4", options=4, predicted=1, answered=True,
                   set=(1, 2), coverage=0.9, adaptive_set=None, adaptive_coverage=None, target=0.9,
                   probs=(0.1, 0.6, 0.25, 0.05), alpha=None, issued=1000, expires=2000)
    return dataclasses.replace(base, **changes)


class TestReceipts:
    def test_round_trip(self):
        r = receipt(alpha=(1.0, 3.5, 2.0, 1.0), adaptive_set=(1,), adaptive_coverage=0.9)
        assert verify(sign(r, KEY), KEY, now=1500) == r

    def test_expiry_is_inclusive_of_its_second(self):
        token = sign(receipt(), KEY)
        assert verify(token, KEY, now=2000).id
        with pytest.raises(ReceiptExpired, match="expired 1 s ago"):
            verify(token, KEY, now=2001)

    @pytest.mark.parametrize("mangle", [
        lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),  # mac changed
        lambda t: t.replace(".", ".x", 1),  # payload changed
        lambda t: "v2" + t[2:],  # unknown version
        lambda t: t + ".extra",
        lambda t: "",
    ])
    def test_any_change_is_refused(self, mangle):
        with pytest.raises(InvalidReceipt):
            verify(mangle(sign(receipt(), KEY)), KEY, now=1500)

    def test_another_key_is_refused(self):
        with pytest.raises(InvalidReceipt, match="signature does not match"):
            verify(sign(receipt(), KEY), b"other", now=1500)

    def test_ids_are_unique(self):
        assert len({new_id() for _ in range(1000)}) == 1000


def row(receipt_id: str, label: int = 1, recorded: float = 2.0, credential: str | None = None) -> dict:
    values = {c: None for c in COLUMNS}
    values.update(receipt_id=receipt_id, question="q", adapter="default", version="4", options=4, label=label,
                  predicted=1, answered=1, probs="[0.1, 0.6, 0.25, 0.05]", issued=1.0, recorded=recorded,
                  credential=credential)
    return values


class TestStore:
    def test_a_receipt_is_kept_once_across_two_connections(self, tmp_path):
        db = tmp_path / "f.sqlite"
        one, two = FeedbackStore(db), FeedbackStore(db)
        assert one.add([row("a"), row("b"), row("a")]) == ["recorded", "recorded", "duplicate"]
        assert two.add([row("b"), row("c")]) == ["duplicate", "recorded"]
        assert [r["receipt_id"] for r in one.since(0)] == ["a", "b", "c"]
        assert [r["receipt_id"] for r in two.since(2)] == ["c"]
        assert len(one.labelled("default", "4")) == 3 and one.labelled("default", "5") == []

    def test_a_receipt_keeps_its_first_label(self, tmp_path):
        """Another label for a recorded receipt (by the other connection, or earlier in the same rows) is a
        conflict, and a conflict writes nothing of its rows."""
        db = tmp_path / "f.sqlite"
        one, two = FeedbackStore(db), FeedbackStore(db)
        assert one.add([row("a", label=1)]) == ["recorded"]
        assert two.add([row("b"), row("a", label=2)]) == ["recorded", "conflict"]
        assert one.add([row("c", label=0), row("c", label=3)]) == ["recorded", "conflict"]
        assert [(r["receipt_id"], r["label"]) for r in one.since(0)] == [("a", 1)]
        assert two.add([row("a", label=1)]) == ["duplicate"]

    def test_a_quota_counts_a_credentials_labels_in_its_window_on_every_connection(self, tmp_path):
        db = tmp_path / "f.sqlite"
        one, two = FeedbackStore(db), FeedbackStore(db)
        quota = LabelQuota("label_token", labels=3, window_s=100)
        assert one.add([row("a", recorded=1000.0, credential="label_token")], quota) == ["recorded"]
        assert one.add([row("b", recorded=1010.0, credential="label_token")], quota) == ["recorded"]
        assert two.add([row("c", recorded=1030.0, credential="label_token")], quota) == ["recorded"]
        assert one.add([row("x", recorded=1030.0)]) == ["recorded"]  # no quota: the Python API's labels
        with pytest.raises(TooManyLabels) as e:  # 3 in the window: the fourth waits until a drops out
            two.add([row("d", recorded=1050.0, credential="label_token")], quota)
        assert e.value.retry_after == 50 and "recorded 3 labels in the last 100 s" in e.value.message
        with pytest.raises(TooManyLabels) as e:  # two more: until b drops out too
            two.add([row("d", recorded=1050.0, credential="label_token"),
                     row("e", recorded=1050.0, credential="label_token")], quota)
        assert e.value.retry_after == 60
        assert two.add([row("a", recorded=1050.0, credential="label_token")], quota) == ["duplicate"]  # not new
        assert two.add([row("d", recorded=1100.0, credential="label_token")], quota) == ["recorded"]  # a is out
        other = LabelQuota("anonymous", labels=3, window_s=100)  # another credential has its own count
        assert one.add([row("f", recorded=1100.0, credential="anonymous")], other) == ["recorded"]
        with pytest.raises(TooLarge, match="4 new labels in one request"):
            one.add([row(f"g{i}", recorded=1100.0, credential="anonymous") for i in range(4)], other)
        assert [r["receipt_id"] for r in one.since(0)] == ["a", "b", "c", "x", "d", "f"]

    def test_a_quota_is_checked(self):
        with pytest.raises(ValueError, match="labels must be >= 1, got 0"):
            LabelQuota("label_token", 0, 60)
        with pytest.raises(ValueError, match="window_s must be > 0, got 0"):
            LabelQuota("label_token", 10, 0)

    def test_a_store_of_the_previous_version_gains_the_credential_column(self, tmp_path):
        db = tmp_path / "old.sqlite"
        with sqlite3.connect(db) as conn:  # the table before labels were counted per credential
            conn.execute(SCHEMA.replace(",\n    credential TEXT", ""))
            values = row("old")
            del values["credential"]
            conn.execute(f"INSERT INTO feedback ({', '.join(values)}) VALUES ({', '.join('?' * len(values))})",
                         list(values.values()))
        one, two = FeedbackStore(db), FeedbackStore(db)  # the second finds the column added
        assert [(r["receipt_id"], r["credential"]) for r in two.since(0)] == [("old", None)]
        assert one.add([row("new", credential="label_token")]) == ["recorded"]

    def test_a_failed_transaction_records_nothing(self, tmp_path):
        store = FeedbackStore(tmp_path / "f.sqlite")
        bad = row("z")
        bad["options"] = None  # NOT NULL
        with pytest.raises(sqlite3.IntegrityError):
            store.add([row("y"), bad])
        assert store.since(0) == []

    def test_a_file_of_another_schema_is_a_clear_error(self, tmp_path):
        db = tmp_path / "old.sqlite"
        with sqlite3.connect(db) as conn:
            conn.execute("CREATE TABLE feedback (seq INTEGER PRIMARY KEY, receipt_id TEXT)")
        with pytest.raises(ValueError, match="another version of ibedl"):
            FeedbackStore(db)


class TestQuantileTracker:
    @pytest.mark.parametrize("rate", [0.005, 0.05])
    def test_long_run_miscoverage_bound_on_an_adversarial_sequence(self, rate):
        """|mean(err) - alpha| <= (B + rate) / (rate T) on any sequence (Angelopoulos et al. 2023, Prop. 1): here the
        scores jump between regimes the threshold cannot anticipate."""
        rng = np.random.default_rng(0)
        alpha, T = 0.1, 4000
        tracker = QuantileTracker(0.5, alpha, rate)
        errs = []
        for t in range(T):
            score = rng.uniform(0.0, 0.3) if (t // 500) % 2 == 0 else rng.uniform(0.5, 1.0)  # shift every 500
            covered = score <= tracker.quantile
            errs.append(not covered)
            tracker.update(covered)
        assert abs(np.mean(errs) - alpha) <= (SCORE_BOUND + rate) / (rate * T)
        assert tracker.labels == T and tracker.misses == sum(errs)

    def test_sets_as_served_keep_the_bound_after_easy_traffic_and_recover_after_a_shift(self):
        """Through the sets the service builds (Feedback.adaptive_set: the rule's set, empty below every score,
        counted as the receipt counts it; the answer shows the top option alone then). 20,000 easy calibrated
        4-option questions (top-1 right about 95% of the time, above 1 - alpha), then 2,000 flat ones. The
        threshold stays within [-alpha rate, B + rate] (counting the shown set instead let it fall to -8.0 and
        the shown sets then missed 54% of the 2,000 labels after the shift, 12% here); both phases keep the bound,
        and the shown sets cover at least as often as counted."""
        rng = np.random.default_rng(3)
        alpha, rate = 0.1, 0.01
        tracker = QuantileTracker(0.5, alpha, rate)
        lowest, counted, shown = tracker.quantile, [], []
        for t in range(22_000):
            logits = rng.normal(0.0, 12.0 if t < 20_000 else 0.3, 4)
            p = np.exp(logits - logits.max())
            p /= p.sum()
            label = int(rng.choice(4, p=p))  # calibrated: the label is drawn from the probabilities
            rule = prediction_set(p, tracker.quantile, "lac", never_empty=False)
            counted.append(label not in rule)
            shown.append(label not in (rule or [int(np.argmax(p))]))
            tracker.update(label in rule)
            lowest = min(lowest, tracker.quantile)
        assert lowest >= -alpha * rate - 1e-12
        for phase in (slice(0, 20_000), slice(20_000, None)):
            T, err = len(counted[phase]), np.mean(counted[phase])
            bound = (SCORE_BOUND + rate) / (rate * T) + alpha * rate / (rate * T)  # q starts within [-alpha rate, B]
            assert abs(err - alpha) <= bound and np.mean(shown[phase]) <= err
        assert np.mean(shown[20_000:]) <= 0.16  # 0.1 + 0.0505; 0.54 with the shown sets counted

    def test_misses_widen_and_hits_narrow(self):
        tracker = QuantileTracker(0.5, 0.1, 0.01)
        tracker.update(False)
        assert tracker.quantile == pytest.approx(0.509)
        tracker.update(True)
        assert tracker.quantile == pytest.approx(0.508)

    def test_a_tracker_set_from_its_counts_is_the_one_that_saw_the_labels(self):
        """A replica restored from the store's checkpoint sets the counts: the same threshold, bit for bit."""
        rng = np.random.default_rng(1)
        seen = QuantileTracker(0.37, 0.1, 0.013)
        for covered in rng.random(5000) < 0.85:
            seen.update(bool(covered))
        restored = QuantileTracker(0.37, 0.1, 0.013)
        restored.restore(seen.labels, seen.misses)
        assert restored.quantile == seen.quantile
        with pytest.raises(ValueError, match="need 0 <= misses <= labels, got misses 3, labels 2"):
            restored.restore(2, 3)

    def test_arguments_are_checked(self):
        with pytest.raises(ValueError, match="rate must be > 0, got 0"):
            QuantileTracker(0.5, 0.1, 0)
        with pytest.raises(ValueError, match="alpha must be in"):
            QuantileTracker(0.5, 1.0, 0.1)


class TestSettings:
    def test_a_short_key_is_refused_with_its_length(self):
        from pydantic import ValidationError

        from ibedl.engine.settings import EngineSettings

        with pytest.raises(ValidationError, match="feedback_key must be at least 16 characters.*got 5"):
            EngineSettings(feedback_key="short")
        assert EngineSettings(feedback_key="x" * 16).feedback_key.get_secret_value() == "x" * 16

    def test_a_keys_whitespace_is_dropped_and_empty_is_off(self, monkeypatch):
        from ibedl.engine.settings import EngineSettings

        assert EngineSettings(feedback_key=" " + "k" * 16 + "\n").feedback_key.get_secret_value() == "k" * 16
        monkeypatch.setenv("IBEDL_FEEDBACK_KEY", "")  # what compose passes when .env sets none
        assert EngineSettings().feedback_key is None

    def test_adaptive_sets_need_feedback(self):
        from pydantic import ValidationError

        from ibedl.engine.settings import EngineSettings

        with pytest.raises(ValidationError, match="IBEDL_ADAPTIVE_SETS needs IBEDL_FEEDBACK_KEY"):
            EngineSettings(adaptive_sets=True)

    def test_a_bad_key_or_dsn_is_never_quoted(self):
        """The errors name the setting and the rule, never what was given: a key, a DSN's password."""
        from pydantic import ValidationError

        from ibedl.engine.settings import EngineSettings

        with pytest.raises(ValidationError) as e:
            EngineSettings(feedback_key="short-secret")
        assert "short-secret" not in str(e.value) and "got 12" in str(e.value)
        for dsn, rule in [("mysql://u:pw-1234@db/x", "does not start with postgresql://"),
                          ("postgresql://u:pw-1234@[db/x", "does not parse")]:
            with pytest.raises(ValidationError, match=rule) as e:
                EngineSettings(feedback_dsn=dsn)
            assert "pw-1234" not in str(e.value)
        settings = EngineSettings(feedback_dsn=" postgresql://u:pw-1234@db:5432/x\n")
        assert settings.feedback_dsn.get_secret_value() == "postgresql://u:pw-1234@db:5432/x"
        assert "pw-1234" not in repr(settings) and "pw-1234" not in str(settings)
        assert EngineSettings(feedback_dsn="").feedback_dsn is None  # compose's empty default: no DSN

    def test_one_store_and_a_retention_that_outlives_the_receipts(self, tmp_path):
        from pydantic import ValidationError

        from ibedl.engine.settings import EngineSettings

        with pytest.raises(ValidationError, match="both name a feedback store") as e:
            EngineSettings(feedback_db=tmp_path / "f.sqlite", feedback_dsn="postgresql://u:pw-1234@db/x")
        assert "pw-1234" not in str(e.value)
        with pytest.raises(ValidationError, match=r"RETENTION_DAYS \(10\) is shorter than IBEDL_FEEDBACK_TTL_S"):
            EngineSettings(feedback_retention_days=10)
        assert EngineSettings(feedback_retention_days=10, feedback_ttl_s=86400).feedback_retention_days == 10
        assert EngineSettings(feedback_retention_days=0).feedback_retention_days == 0  # kept for ever
