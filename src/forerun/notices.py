"""Other packages' import-time notices that tell forerun's user nothing, dropped as forerun is imported.

Importing transformers imports torchao where it is installed (the `quantize` extra), and two kinds of lines then
opened every `forerun` command's output and every script's: torchao failing to load its CUDA-only extensions on a
CPU build of torch ("Failed to load .../torchao/_C_mxfp8...so: Could not load this library"), and torch noting that
torchao registers its enums in a deprecated way. Neither affects what forerun runs. `import forerun` filters
exactly those records out of those two loggers, before it imports transformers; every other record of theirs
still shows. (Where transformers was imported first, they were printed already.)

Example:
    >>> drop_import_notices()
    >>> logging.getLogger("torchao").filter(logging.makeLogRecord({"msg": "Failed to load x/_C_mxfp8.so: gone"}))
    False
    >>> bool(logging.getLogger("torchao").filter(logging.makeLogRecord({"msg": "something else"})))
    True
"""

from __future__ import annotations

import logging

NOTICES = {
    "torchao": "Failed to load ",
    "torch.utils._pytree": "is an Enum subclass and is now natively supported",
}
"""Logger name -> the words that mark its notice (the beginning of torchao's, a phrase of torch's)."""


class ImportNotice(logging.Filter):
    """Drops a logger's records that carry `words`."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        return self.words not in record.getMessage()


def drop_import_notices() -> None:
    """Filter the `NOTICES` out of their loggers (once, however often it is called); before transformers is
    imported, since they are logged while it imports."""
    for name, words in NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, ImportNotice) for f in logger.filters):
            logger.addFilter(ImportNotice(words))
