"""CRC-32 of bytes: ISA-L's when installed (several times faster than zlib's), zlib's otherwise; same values."""

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - optional dependency (the ``fast`` extra)
    from zlib import crc32

__all__ = ["crc32"]
