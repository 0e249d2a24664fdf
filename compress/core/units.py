"""The one size parser: ``500MB``, ``2GB``, ``1TB``, ``64KiB`` or a byte count.

Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB ... TiB) powers of 1024,
as ``save_pretrained`` reads them. Option validators (``--max-shard-size``) and the shard
writer both parse with :func:`parse_size`, so a size that validates is a size that writes.

>>> parse_size("2GB"), parse_size("64KiB"), parse_size("1TB"), parse_size(123)
(2000000000, 65536, 1000000000000, 123)
>>> check_size(" 500MB ")
'500MB'
"""

from __future__ import annotations

import re

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(" + "|".join(_UNITS) + r")$", re.IGNORECASE)


def parse_size(size: str | int) -> int:
    """Bytes of ``size``; ValueError naming the accepted forms if it is not one."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"size {size} must be a positive number of bytes")
        return size
    text = str(size).strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"size '{size}' is not like 500MB, 2GB or 64KiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def check_size(text: str) -> str:
    """``text`` stripped, if it is a size with a unit (a config field's validator)."""
    if not _SIZE.match(str(text).strip()):
        raise ValueError(f"size '{text}' is not like 500MB, 2GB or 64KiB")
    parse_size(text)
    return str(text).strip()
