"""The engine both front doors share: the HTTP service (``ibedl.serve``) and the Python API (``ibedl.api``,
``ibedl.batch``). Adapters loaded on one base model (``runtime``), requests checked (``requests``), answers built
(``responses``: abstention, conformal sets, the model card), drift statistics (``drift``), the request and
response records (``schemas``), and the feedback loop (``feedback``: signed ``receipts`` in answers, labels recorded
once, realised guarantees with a ``confidence_sequence``, ``adaptive`` conformal sets).
"""
