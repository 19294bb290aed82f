"""YAML loading that remembers line numbers, so errors can point at the offending line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kernel_hub.errors import SourceError


class SourceMap(dict):
    """A mapping read from YAML; ``line`` is where it starts, ``lines[key]`` where each key is."""

    line: int
    lines: dict[str, int]


class SourceList(list):
    """A sequence read from YAML; ``line`` is where it starts."""

    line: int


_C_PARSER = hasattr(yaml, "CSafeLoader")


class _LineLoader(yaml.CSafeLoader if _C_PARSER else yaml.SafeLoader):  # type: ignore[misc]
    """The safe loader, on libyaml's parser where PyYAML was built with it (about ten times
    faster than the pure-Python one; it limits nesting depth itself)."""


def _construct_map(loader: _LineLoader, node: yaml.MappingNode) -> SourceMap:
    result = SourceMap()
    result.line = node.start_mark.line + 1
    result.lines = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            raise SourceError(
                loader.name, key_node.start_mark.line + 1, f"keys must be strings, got {key!r}"
            )
        if key in result:
            raise SourceError(
                loader.name,
                key_node.start_mark.line + 1,
                f"duplicate key {key!r} (first at line {result.lines[key]})",
            )
        result[key] = loader.construct_object(value_node, deep=True)
        result.lines[key] = key_node.start_mark.line + 1
    return result


def _construct_seq(loader: _LineLoader, node: yaml.SequenceNode) -> SourceList:
    result = SourceList(loader.construct_object(child, deep=True) for child in node.value)
    result.line = node.start_mark.line + 1
    return result


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_seq)


def load_yaml(path: str | Path, text: str | None = None) -> Any:
    """Parse a YAML file; any failure (syntax, characters YAML forbids, bytes that are not UTF-8,
    nesting too deep) becomes a ``SourceError`` with the file and, where known, the line."""
    path = Path(path)
    if text is None:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise SourceError(path, None, "file not found") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise SourceError(path, line, f"not UTF-8 text ({exc.reason})") from None
    loader = None
    try:
        loader = _LineLoader(text)  # the pure-Python reader checks the characters here
        loader.name = str(path)
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        message = f"invalid YAML: {exc.problem or exc.context}"
        if exc.context and exc.context_mark is not None and exc.problem:
            message += f" ({exc.context} at line {exc.context_mark.line + 1})"
        raise SourceError(path, line, message) from None
    except yaml.reader.ReaderError as exc:
        # libyaml counts the position in UTF-8 bytes, the pure-Python reader in characters
        before = text.encode("utf-8")[: exc.position] if _C_PARSER else text[: exc.position]
        line = before.count(b"\n" if _C_PARSER else "\n") + 1
        raise SourceError(
            path, line, f"invalid YAML: character {exc.character:#x} is not allowed"
        ) from None
    except RecursionError:
        raise SourceError(path, None, "invalid YAML: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def line_of(node: Any, key: str | None = None) -> int | None:
    """Best line for ``node[key]`` (or ``node`` itself) when ``node`` came from ``load_yaml``."""
    if key is not None and isinstance(node, SourceMap) and key in node.lines:
        return node.lines[key]
    return getattr(node, "line", None)


def key_lines(node: Any, prefix: str = "") -> dict[str, int]:
    """``{prefix + key: line}`` for each key of a mapping read by ``load_yaml``."""
    return {prefix + key: line for key, line in getattr(node, "lines", {}).items()}


class FieldReader:
    """Reads typed fields from one YAML mapping, raising ``SourceError`` at the right line."""

    def __init__(
        self, path: str | Path, node: Any, context: str, allowed: set[str], line: int | None = None
    ):
        """``line`` locates ``node`` when it is a scalar (scalars do not remember their line)."""
        self.path = Path(path)
        self.context = context
        if not isinstance(node, dict):
            raise SourceError(
                path,
                line_of(node) or line or 1,  # 1: the document itself is not a mapping
                f"{context}: expected a mapping, got {type(node).__name__}",
            )
        self.node = node
        self.line = line or line_of(node)
        unknown = sorted(set(node) - allowed)
        if unknown:
            raise SourceError(
                path,
                line_of(node, unknown[0]),
                f"{context}: unknown field {unknown[0]!r}; "
                f"valid fields: {', '.join(sorted(allowed))}",
            )

    def error(self, key: str | None, message: str) -> SourceError:
        where = f"{self.context}: field {key!r}" if key else self.context
        line = line_of(self.node, key) if key else self.line
        return SourceError(self.path, line, f"{where}: {message}")

    def get(
        self,
        key: str,
        kind: type | tuple[type, ...],
        default: Any = ...,
    ) -> Any:
        if key not in self.node:
            if default is ...:
                raise self.error(None, f"missing required field {key!r}")
            return default
        value = self.node[key]
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            names = (
                kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            )
            raise self.error(key, f"expected {names}, got {type(value).__name__} {value!r}")
        return value

    def get_str_list(self, key: str, default: Any = ...) -> tuple[str, ...]:
        value = self.get(key, list, default)
        if value is default:
            return value
        for item in value:
            if not isinstance(item, str):
                raise self.error(key, f"expected a list of strings, found {item!r}")
        return tuple(value)
