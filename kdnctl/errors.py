"""Domain errors. The CLI maps every KdnError to one line on stderr, a hint and an exit code.

Library code raises these instead of printing or exiting, so the same failures are usable
from Python. ``EXIT_CODES`` is the one table of exit codes.

Messages speak of values and parameters (``alpha must be in (0, 1]``), never of command-line
flags: an error about one argument names it in ``param`` (the library's parameter name), and
the CLI maps that to its flag (``kdnctl.cli.common.FLAGS``).
"""

from __future__ import annotations


class KdnError(Exception):
    """Base of every error kdnctl reports to a user."""

    exit_code = 1
    default_hint = ""
    default_param: str | None = None

    def __init__(self, message: str, hint: str | None = None, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        self.param = param if param is not None else self.default_param  # the parameter it is about

    def __reduce__(self):
        # Pickle with every attribute (the hint too): errors cross process boundaries when a
        # distributed worker raises them (kdnctl/distributed).
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))

    def one_line(self, flag: str | None = None) -> str:
        """``error: MESSAGE (hint: HINT)``; with ``flag`` (the CLI's spelling of ``param``) the
        parameter's name at the start of the message becomes the flag, or the flag is appended."""
        message = self.message
        if flag and self.param:
            if message.startswith(self.param):
                message = flag + message[len(self.param):]
            else:
                message += f" ({flag})"
        text = f"error: {message}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return " ".join(text.split())


def _rebuild(cls: type, message: str, state: dict) -> "KdnError":
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class UsageError(KdnError):
    """Bad option values, e.g. a budget outside (0, 1]."""

    exit_code = 2
    default_hint = "see --help"


class InputError(KdnError):
    """A missing, empty, binary or undecodable input path."""

    exit_code = 3
    default_hint = "check the path you passed"


class NotFoundError(KdnError):
    """A document, version label, chunk or object that is not in the store."""

    exit_code = 4
    default_hint = "run `kdnctl ls` to see what is stored"


class ModelMismatchError(KdnError):
    """A bundle made with another model (fingerprint differs)."""

    exit_code = 5
    default_hint = "load the bundle with the model it was made with, or re-ingest"
    default_param = "model"


class BundleFormatError(KdnError):
    """A bundle that cannot be decoded: truncated, corrupted, bad shapes, unknown major version."""

    exit_code = 6
    default_hint = "run `kdnctl verify`; re-ingest the document if the object is damaged"


class StoreCorruptError(KdnError):
    """An object whose bytes no longer match its hash, or a dangling catalog reference."""

    exit_code = 6
    default_hint = "run `kdnctl verify` for the full list; re-ingest affected documents"


class StoreLockedError(KdnError):
    """A second writer tried to open the store while another holds the write lock."""

    exit_code = 7
    default_hint = "another kdnctl command is writing to this store; wait for it to finish"


class StoreReadOnlyError(StoreLockedError):
    """A write (ingest, compress, gc, rebuild-catalog) to a store on a read-only filesystem or
    without write permission; reads still work."""

    default_hint = "reads (ls, show, verify, ask) still work; writes need a writable copy of the store"


class ModelLoadError(KdnError):
    """The model path is missing or not a model kdnctl can load."""

    exit_code = 8
    default_hint = "give a HF model directory or a .gguf file"
    default_param = "model"


class RemoteError(KdnError):
    """A remote store (serve-files) failed or answered something unusable."""

    exit_code = 9
    default_hint = "check the URL, the token and that `kdnctl serve-files` is running"


class UnsupportedError(KdnError):
    """An operation this model or bundle cannot support (e.g. a RoPE type we cannot re-rotate)."""

    exit_code = 10


class MissingExtraError(KdnError):
    """An optional feature whose extra is not installed (e.g. ``--ray`` without ray)."""

    exit_code = 11


class WorkerError(KdnError):
    """A distributed job failed: a worker crashed more often than its retries allow, or the
    cluster could not be reached."""

    exit_code = 12
    default_hint = "documents committed before the failure are kept; re-run the same command to resume"


class EngineMissingError(MissingExtraError):
    """An optional engine package (LMCache, llama-cpp-python) an export or a check needs."""

    default_hint = "install the extra: pip install 'kdnctl[lmcache]' or 'kdnctl[llamacpp]'"


class ExportError(KdnError):
    """A version that the target engine's format cannot hold (pruned for LMCache, per-head
    selections for llama.cpp, a chunk size the engine does not use, another model's GGUF)."""

    exit_code = 13
    default_hint = "see docs/engines.md for what each export accepts"


EXIT_CODES: dict[type[KdnError], int] = {
    cls: cls.exit_code
    for cls in (
        KdnError,
        UsageError,
        InputError,
        NotFoundError,
        ModelMismatchError,
        BundleFormatError,
        StoreCorruptError,
        StoreLockedError,
        StoreReadOnlyError,
        ModelLoadError,
        RemoteError,
        UnsupportedError,
        MissingExtraError,
        WorkerError,
        ExportError,
    )
}
