"""Opening a corpus file as a stream of bytes: plain, or compressed (`.gz`, `.bz2`, `.xz`, `.zst`), decompressed
as it is read, never whole. Compressed files are read front to back only (`plan_units` never cuts them). A
damaged or truncated file raises one of `READ_ERRORS` where the damage starts, so readers keep what came before.

zstandard (`.zst`) and pyarrow (`.parquet`, `.arrow`) are optional: `require` names the extra that installs one.
"""

from __future__ import annotations

import bz2
import gzip
import importlib
import io
import lzma
import zlib
from types import ModuleType

from bertforge.errors import BertforgeError

COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
READ_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)
EXTRAS = {"zstandard": ("zstd", ".zst"), "pyarrow": ("parquet", ".parquet and .arrow")}
ZSTD_MAX_WINDOW = 1 << 31  # files written with `zstd --long=31` (the most zstd allows) need this much window
_ZSTD_READ = 1 << 17  # compressed bytes fed to the decompressor at a time


def require(module: str) -> ModuleType:
    """Import an optional dependency, or refuse in one line that names the extra which installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra, what = EXTRAS[module.split(".")[0]]
        raise BertforgeError(f"reading {what} files needs {module}: pip install 'bertforge[{extra}]'") from None


def compression_of(path: str) -> str:
    """The compression suffix of `path` ("" if none)."""
    return next((c for c in COMPRESSIONS if path.endswith(c)), "")


def inner_name(path: str) -> str:
    """`path` without its compression suffix: `a.jsonl.zst` -> `a.jsonl`."""
    return path[:-len(compression_of(path))] if compression_of(path) else path


def open_binary(path: str) -> io.BufferedIOBase:
    """`path` opened for reading bytes, decompressed by its suffix."""
    kind = compression_of(path)
    if kind == ".gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if kind == ".bz2":
        return bz2.open(path, "rb")  # type: ignore[return-value]
    if kind == ".xz":
        return lzma.open(path, "rb")  # type: ignore[return-value]
    if kind == ".zst":
        return io.BufferedReader(_ZstdStream(path))
    return open(path, "rb")


class _ZstdStream(io.RawIOBase):
    """A `.zst` file's decompressed bytes, frame after frame, as a read-only raw stream with `tell`.

    zstandard's own stream reader ends a truncated file silently, as if it were complete; this one raises
    EOFError when the file ends inside a frame, as gzip, bz2 and lzma do."""

    def __init__(self, path: str):
        self._zstd = require("zstandard")
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close(), as the stream's owner closes it)
        self._new_frame()
        self._out = memoryview(b"")
        self._pos = 0

    def _new_frame(self) -> None:
        self._frame = self._zstd.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).decompressobj()
        self._fed = False  # whether this frame has had any input (an empty tail is no truncation)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            if not self._decompress_more():
                return 0
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        self._pos += n
        return n

    def _decompress_more(self) -> bool:
        """Decompress the next piece into `_out`; False at the end of the file."""
        data = b""
        if self._frame.eof:  # a frame ended: what follows it is the next frame
            data = self._frame.unused_data
            self._new_frame()
        if not data:
            data = self._file.read(_ZSTD_READ)
        if not data:
            if self._fed:
                raise EOFError("the .zst file ends inside a frame (truncated)")
            return False
        self._fed = True
        try:
            self._out = memoryview(self._frame.decompress(data))
        except self._zstd.ZstdError as e:
            raise OSError(f"damaged .zst data: {e}") from None
        return True

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()
