"""Typed reads of a model file's configuration values, each failure a `ModelFileError`.

GGUF metadata and ``config.json`` differ in where a value comes from and how a key is
named in a message; what a count, a positive number or a string must be is the same,
and lives here once.
"""

import math
from typing import Any

from ..errors import ModelFileError

MISSING = object()  # a required value: no default


class TypedReader:
    """Subclasses say where a value is (`get`; None is absent) and how an error names its
    key (`wrong`, `missing`); the reads check the type and range."""

    def get(self, key: str, default: Any = None) -> Any:
        raise NotImplementedError

    def wrong(self, key: str, value: Any, expected: str) -> ModelFileError:
        raise NotImplementedError

    def missing(self, key: str) -> ModelFileError:
        raise NotImplementedError

    def integer(self, key: str, default: Any = MISSING) -> Any:
        value = self._value(key, default)
        if value is default or is_int(value):
            return value
        raise self.wrong(key, value, "an integer")

    def count(self, key: str, default: Any = MISSING) -> Any:
        value = self._value(key, default)
        if value is default or (is_int(value) and value > 0):
            return value
        raise self.wrong(key, value, "a positive integer")

    def positive(self, key: str, default: Any = MISSING) -> Any:
        """A finite number > 0, as a float (an integer too: at most 64 bits in a GGUF)."""
        value = self._value(key, default)
        if value is default:
            return value
        if (is_int(value) or isinstance(value, float)) and 0 < value < math.inf:
            return float(value)
        raise self.wrong(key, value, "a finite number > 0")

    def string(self, key: str, default: Any = MISSING) -> Any:
        value = self._value(key, default)
        if value is default or isinstance(value, str):
            return value
        raise self.wrong(key, value, "a string")

    def boolean(self, key: str, default: Any = MISSING) -> Any:
        value = self._value(key, default)
        if value is default or isinstance(value, bool):
            return value
        raise self.wrong(key, value, "a boolean")

    def _value(self, key: str, default: Any) -> Any:
        value = self.get(key)
        if value is not None:
            return value
        if default is MISSING:
            raise self.missing(key)
        return default


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
