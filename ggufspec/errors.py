"""Errors a user can act on. Each carries a one-line message and the exit code the CLI uses."""


class GgufspecError(Exception):
    """A bad input or an unmet precondition: one line for the user, exit code 2."""

    exit_code = 2


class ModelFileError(GgufspecError):
    """A model path that is missing, not a GGUF file, or that llama.cpp refused to load."""


class IncompatibleModelsError(GgufspecError):
    """Target and draft cannot be paired: their vocabularies differ."""


class ContextFullError(GgufspecError):
    """The prompt does not fit in the context window."""


class DecodeError(GgufspecError):
    """llama_decode returned an error code."""

    exit_code = 1


class CacheFullError(DecodeError):
    """llama_decode found no room in the KV cache (code 1): with parallel slots, the others' sequences
    hold the cells. A generation under way ends there as at the context's end; a prompt may retry."""


class Interrupted(GgufspecError):
    """A decode stopped between two of its chunks, its caller having asked (`Context.should_stop`): a
    client gone while its long prompt was being evaluated."""


class StoreError(GgufspecError):
    """A download, verification or cache problem."""

    exit_code = 1


class ToolError(GgufspecError):
    """A tool, tool_choice, JSON schema or grammar the request got wrong."""


class BadReferenceError(GgufspecError):
    """A model reference (`hf://OWNER/REPO/FILE.gguf`, `OWNER/REPO:QUANT`) that is malformed."""


class UnsafeNameError(StoreError):
    """A file name from a hub, a reference or models.toml that would not land inside the store."""
