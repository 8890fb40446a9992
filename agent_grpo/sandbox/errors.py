"""The error the sandbox modules raise when the sandbox itself fails (not the code it runs)."""

__all__ = ["SandboxError"]


class SandboxError(RuntimeError):
    """The sandbox itself could not be set up (not an error of the code it runs)."""
