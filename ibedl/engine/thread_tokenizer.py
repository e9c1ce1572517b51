"""One tokenizer copy per thread, for counting prompt tokens off the model's thread. A Hugging Face fast tokenizer (its
Rust half) must not be called from two threads at once: a call that changes its truncation or padding while another
encodes raises "Already borrowed" or leaves the other with the wrong settings. The service checks requests on its
pool of check threads (``IBEDL_CHECK_THREADS``), the Python API (``Engine.predict``, ``Engine.check``) on whichever
thread calls it."""

from __future__ import annotations

import copy
import threading


class PerThreadTokenizer:
    """Each thread's own deep copy of a tokenizer, made on its first :meth:`get` from a template copied once here
    (never from the original, which the model's thread may be using meanwhile) and dropped with the thread.

    Args:
        tokenizer: the base model's tokenizer; it is copied now, before any thread asks, and never handed out.

    Attributes:
        source: ``tokenizer``, kept only to say which tokenizer the copies equal (ibedl.core.predictor.TokenizedQuestion
            compares it by identity); never called here.
    """

    def __init__(self, tokenizer) -> None:
        if not callable(tokenizer):
            raise ValueError(f"tokenizer must be a callable tokenizer, got {type(tokenizer).__name__}")
        self.source = tokenizer
        self._template = copy.deepcopy(tokenizer)
        self._copying = threading.Lock()  # the template is read by one deep copy at a time
        self._local = threading.local()

    def get(self):
        """The calling thread's tokenizer (copied from the template on the thread's first call)."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            with self._copying:
                tokenizer = copy.deepcopy(self._template)
            self._local.tokenizer = tokenizer
        return tokenizer


__all__ = ["PerThreadTokenizer"]
