"""What a feedback store is to the feedback engine (``ibedl.engine.feedback``): the labels, each kept once and in
commit order, and the checkpoint of the realised guarantees, behind one interface in the domain's terms
(:class:`FeedbackStore`). The stores that implement it share their SQL (``ibedl.engine.feedback_sql``): SQLite
(``ibedl.engine.feedback_sqlite``, ``IBEDL_FEEDBACK_DB``: one file in WAL mode, the zero-setup store of the replicas
of one host; in memory without a file) and PostgreSQL (``ibedl.engine.feedback_postgres``, ``IBEDL_FEEDBACK_DSN``:
replicas on several nodes); which one settings or a command line name is chosen in ``ibedl.engine.feedback_kinds``.

A store holds the labels, each once (its receipt id is unique; a receipt keeps its first label) and in commit order
(``seq``: writers take one lock, so a reader that has seen a label has seen every label before it), and a
checkpoint: the state of every realised guarantee's confidence sequence as of one label (``seq``). A replica starts
from the checkpoint and replays only the labels after it, so its start does not grow with the labels stored;
whichever replica has folded labels past the checkpoint moves it (every replica folds the same labels in the same
order, so any of them may). Raw labels older than the retention are deleted once the checkpoint holds them: the
guarantees keep counting them.
"""

from __future__ import annotations

import abc
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass

from ibedl.engine.errors import TooLarge, TooManyLabels

# one label: what its receipt said and what was sent back, when, by which credential
COLUMNS = ("receipt_id", "question", "adapter", "version", "options", "label", "predicted", "answered", "target",
           "covered", "coverage", "adaptive_covered", "adaptive_coverage", "probs", "alpha", "issued", "recorded",
           "credential", "calibration")
# what a replica folds into the guarantees and the adaptive thresholds (not the question, outputs or credential)
REPLAYED = ("seq", "adapter", "version", "options", "answered", "target", "label", "predicted", "covered", "coverage",
            "adaptive_covered", "adaptive_coverage", "recorded")

# a key of the checkpoint's states: (adapter, version, guarantee, stated) a realised guarantee's confidence sequence;
# (adapter, version, guarantee, stated, options) its change detector for one option count; (adapter, version,
# "suspended") the record of a version whose promises labelled feedback suspended (ibedl.engine.feedback)
Series = tuple


@dataclass(frozen=True)
class LabelQuota:
    """At most ``labels`` new labels per ``window_s`` seconds from one ``credential`` (its name in the store), every
    replica's together: the store counts them."""

    credential: str
    labels: int
    window_s: float

    def __post_init__(self) -> None:
        if self.labels < 1:
            raise ValueError(f"labels must be >= 1, got {self.labels}")
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")


@dataclass(frozen=True)
class Checkpoint:
    """The store's checkpoint as a replica that has folded the labels through ``after`` reads it, with the labels
    recorded after it, from one consistent view of the store.

    Attributes:
        seq: the label through which the store's states are folded (0: none yet).
        states: the states (``BettingCS.state``, by :data:`Series`) that the checkpoint moved since ``after``; empty
            when it is not past ``after``.
        rows: the labels after ``max(after, seq)``, in order, with the :data:`REPLAYED` columns (a page of them).
    """

    seq: int
    states: dict
    rows: list[dict]


class FeedbackStore(abc.ABC):
    """Labels once by receipt id, in commit order, and the checkpoint of the guarantees' states. Thread-safe; several
    processes and hosts may share one store. Every call waits at most about ``timeout_s`` for the store (another
    writer's lock, a slow server), then raises ``StoreUnavailable``.

    The rules of recording (a receipt keeps its first label; a credential's quota) are written once here, on a few
    primitives a store gives inside one atomic write; reading labels and the checkpoint is the store's own.

    Args:
        where: the store as messages name it (a path; a DSN without its password).
        timeout_s: the longest wait for a lock or an answer, > 0.
    """

    setting = ""  # the setting that names this kind of store, for messages

    def __init__(self, where: str, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.where, self.timeout_s = where, float(timeout_s)

    # -- recording labels -------------------------------------------------------------------------

    def add(self, rows: list[dict], quota: LabelQuota | None = None) -> list[str]:
        """Record ``rows`` (dicts of :data:`COLUMNS`) at once. Per row: ``recorded``; ``duplicate``, its receipt was
        recorded before (here or by another replica, or earlier in ``rows``) with the same label; or ``conflict``,
        with another label (a receipt keeps its first label). Nothing is written when any row conflicts.

        Raises:
            TooManyLabels: the rows would take ``quota.credential`` over its quota (nothing is written).
            TooLarge: ``rows`` hold more new labels than the quota allows in a whole window.
            StoreUnavailable: the store did not answer in time (nothing is written).
        """
        with self._writing():  # the write lock, held from the check to the insert
            seen = self._labels_of(list(dict.fromkeys(row["receipt_id"] for row in rows)))
            statuses = []
            for row in rows:
                rid = row["receipt_id"]
                if rid in seen:
                    statuses.append("duplicate" if seen[rid] == row["label"] else "conflict")
                else:
                    statuses.append("recorded")
                    seen[rid] = row["label"]
            fresh = [row for row, status in zip(rows, statuses, strict=True) if status == "recorded"]
            if "conflict" not in statuses and fresh:
                if quota is not None:
                    self._check_quota(quota, len(fresh), rows[0]["recorded"])
                self._insert(fresh)
        return statuses

    def _check_quota(self, quota: LabelQuota, new: int, now: float) -> None:
        """Raise unless ``quota.credential`` may record ``new`` more labels at ``now`` (inside the write)."""
        if new > quota.labels:
            raise TooLarge(f"{new} new labels in one request; the labelling credential may record {quota.labels} "
                           f"per {quota.window_s:g} s (IBEDL_MAX_LABELS): send them in smaller batches", "items")
        since = now - quota.window_s
        count = self._count_recorded(quota.credential, since)
        if count + new <= quota.labels:
            return
        # the labels recorded in the window drop out oldest first: wait until enough of them have
        oldest = self._recorded_at(quota.credential, since, count + new - quota.labels - 1)
        wait = max(1, math.ceil(oldest + quota.window_s - now))
        raise TooManyLabels(f"this labelling credential recorded {count} labels in the last {quota.window_s:g} s; "
                            f"it may record {quota.labels} per window (IBEDL_MAX_LABELS per IBEDL_LABEL_WINDOW_S): "
                            f"retry after {wait} s", retry_after=wait)

    # what a store gives to record: one atomic write, and what is read and written inside it

    @abc.abstractmethod
    def _writing(self) -> AbstractContextManager[None]:
        """One atomic write: it holds the store's one write lock from its first read to its end (so ``seq`` grows
        in commit order), writes everything when the block ends and nothing when it raises (StoreUnavailable when
        the store does not answer within the timeout)."""

    @abc.abstractmethod
    def _labels_of(self, receipt_ids: list[str]) -> dict[str, int]:
        """The stored label of each of ``receipt_ids`` that has one, by receipt id."""

    @abc.abstractmethod
    def _insert(self, rows: list[dict]) -> None:
        """Append ``rows`` (new receipts, dicts of :data:`COLUMNS`) in order, each with the next ``seq``."""

    @abc.abstractmethod
    def _count_recorded(self, credential: str, since: float) -> int:
        """How many labels ``credential`` recorded after ``since`` (unix seconds)."""

    @abc.abstractmethod
    def _recorded_at(self, credential: str, since: float, rank: int) -> float:
        """When the label number ``rank`` (0: the oldest) of those ``credential`` recorded after ``since`` was
        recorded."""

    # -- reading labels ---------------------------------------------------------------------------

    @abc.abstractmethod
    def since(self, seq: int) -> list[dict]:
        """The stored labels recorded after ``seq``, in order, each with its ``seq`` and the :data:`COLUMNS` (labels
        past the retention are gone: the checkpoint counts them)."""

    @abc.abstractmethod
    def labelled(self, adapter: str, version: str, from_seq: int = 0) -> list[dict]:
        """Every stored label of one adapter version from sequence number ``from_seq`` on, in order, as
        :meth:`since` gives them (what a recalibration on the traffic reads)."""

    # -- the checkpoint ---------------------------------------------------------------------------

    def read(self, after: int, limit: int) -> Checkpoint:
        """What a replica that has folded the labels through ``after`` needs to catch up: the states the
        checkpoint moved since (when it is past ``after``), then at most ``limit`` labels after both."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        return self._read(after, limit)

    @abc.abstractmethod
    def _read(self, after: int, limit: int) -> Checkpoint:
        """:meth:`read`, its arguments checked, from one consistent view of the store."""

    @abc.abstractmethod
    def state(self, series: Series) -> bytes | None:
        """The checkpoint's state of one series (None: none saved)."""

    @abc.abstractmethod
    def save(self, seq: int, states: dict, prune_before: float | None = None) -> bool:
        """Move the checkpoint to label ``seq``, writing ``states`` (bytes by :data:`Series`: every series that
        changed since the checkpoint this replica last read or wrote), unless the store's checkpoint is already
        there or past it (another replica folded as far: its states are these). Then delete raw labels recorded
        before ``prune_before`` (unix seconds; None: keep them) that the checkpoint holds (a bounded number per
        call: the next save deletes more). Whether the checkpoint moved; one atomic write."""

    @abc.abstractmethod
    def close(self) -> None:
        ...
