"""Errors raised while building a model or loading its checkpoint (loader -> model.load_weights).

Messages name the checkpoint tensor and, for shape problems, the expected and the got shapes, so
a user with a mislabelled or truncated checkpoint sees what is wrong without reading code.
"""

from __future__ import annotations


class WeightLoadError(ValueError):
    def __init__(
        self,
        message: str,
        tensor_name: str | None = None,
        expected: tuple[int, ...] | None = None,
        got: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(message)
        self.tensor_name = tensor_name
        self.expected = expected
        self.got = got

    @classmethod
    def shape_mismatch(cls, name: str, expected: tuple[int, ...], got: tuple[int, ...]) -> WeightLoadError:
        return cls(
            f"checkpoint tensor {name!r} has shape {list(got)}, expected {list(expected)}",
            name,
            tuple(expected),
            tuple(got),
        )

    @classmethod
    def unknown(cls, name: str, architecture: str) -> WeightLoadError:
        return cls(f"checkpoint tensor {name!r} matches no parameter of {architecture}", name)

    @classmethod
    def missing(cls, names: list[str], architecture: str) -> WeightLoadError:
        shown = ", ".join(names[:20]) + (f" ... ({len(names)} in all)" if len(names) > 20 else "")
        return cls(f"checkpoint lacks {len(names)} tensor(s) that {architecture} needs: {shown}")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or one of its config options is not implemented."""
