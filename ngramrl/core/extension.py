"""The compiled part of the core, ``ngramrl._native`` (C++ in ``ngramrl/native/``), where it is
built: the drafting core (``ngramrl.core.native``), the step's array helpers
(``ngramrl.core.batch``) and the step-cost fit (``ngramrl.core.cost``). Each has a Python
reference that gives the same results, used where the extension is not built or
``NGRAMRL_NATIVE=0``."""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)
NEWEST = "request_ends_interface"  # the newest name: an extension without it was built from older sources
_warned = False


def native_module() -> Any | None:
    """The compiled extension, or None (one logged line the first time) when it is not built."""
    global _warned
    try:
        if os.environ.get("NGRAMRL_NATIVE") == "0":
            raise ImportError("NGRAMRL_NATIVE=0")
        from ngramrl import _native

        if not hasattr(_native, NEWEST):
            raise ImportError("ngramrl._native was built from older sources than ngramrl's; rebuild it "
                              "(pip install -e . or python setup.py build_ext --inplace)")
    except ImportError as err:
        if not _warned:
            logger.warning("ngramrl: the native drafting core is not available (%s); using the Python reference", err)
            _warned = True
        return None
    return _native
