"""The engine every door shares: the HTTP service and the Open Inference Protocol over REST and gRPC
(``ibedl.serve``) and the Python API (``ibedl.api``, ``ibedl.batch``). Adapters loaded on one base model
(``runtime``), requests checked (``requests``), answers built (``responses``: abstention, conformal sets, the model
card), their scheduler (``batcher``, ``admission``, ``capacity``), the runtimes that change while it serves
(``versions``, ``backend_switch``), drift statistics (``drift``), the request and response records (``schemas``), and
the feedback loop (``feedback``: signed ``receipts`` in answers, labels recorded once in a store chosen by
``feedback_kinds``, realised guarantees with a ``confidence_sequence``, ``adaptive`` conformal sets).

A door imports only :data:`PUBLIC` (tests/test_imports.py checks ``ibedl.serve``): the rest may change without it.
"""

# The engine's public surface: what a door may import.
PUBLIC = (
    "ibedl.engine.engine",  # Engine, Checked
    "ibedl.engine.context",  # RequestContext, TIMEOUT_HEADER
    "ibedl.engine.observer",  # Observer
    "ibedl.engine.errors",  # EngineError and its kinds
    "ibedl.engine.schemas",  # the request and answer records
    "ibedl.engine.settings",  # EngineSettings
    "ibedl.engine.requests",  # the request rules a door's schema states (NOT_BLANK, max_options)
    "ibedl.engine.drift",  # DriftMonitor, AccuracyEstimate: what an observer may keep
    "ibedl.engine.feedback_kinds",  # which store the settings name
    "ibedl.engine.heap",  # HeapFreezer: a service process's heap out of the garbage collector's scans
)
