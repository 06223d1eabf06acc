"""`import forerun` drops exactly the import-time notices of torchao and torch that say nothing to its user."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from forerun.notices import NOTICES, drop_import_notices


def test_importing_forerun_prints_no_import_notices():
    pytest.importorskip("torchao")  # the notices come from torchao's import (the quantize extra)
    script = "import forerun; forerun.Decoder"  # the first use of a public name imports transformers
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    for words in NOTICES.values():
        assert words not in done.stderr, done.stderr


def test_only_the_notices_are_dropped(caplog):
    drop_import_notices()
    drop_import_notices()  # once, however often
    assert sum(type(f).__name__ == "ImportNotice" for f in logging.getLogger("torchao").filters) == 1
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torchao").warning("a real torchao warning")
        logging.getLogger("torch.utils._pytree").warning("<enum 'X'> is an Enum subclass and is now natively supported")
        logging.getLogger("torch.utils._pytree").warning("another pytree warning")
    assert [r.getMessage() for r in caplog.records] == ["a real torchao warning", "another pytree warning"]
