"""Reading a job file strictly: UTF-8 text of at most 1 MiB, YAML loaded safely (no tag ever
runs code) with the YAML 1.2 core schema's scalars, duplicate keys, non-text keys and deep
nesting refused, and what aliases expand to bounded. Every error is a JobError naming the
source and line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, ScalarNode, SequenceNode
from yaml.reader import ReaderError

from eaglebatch.errors import JobError, echo

MAX_JOB_FILE_BYTES = 1 << 20  # 1 MiB: a job file holds a few dozen keys
MAX_DEPTH = 64  # nesting levels of a job file (a job needs 3)
MAX_ITEMS = 100_000  # keys, values and list items walked, an alias counted each time it is used
MAX_TEXT_CHARS = 2_000_000  # characters of text walked, likewise




class _LoadError(yaml.YAMLError):
    """A problem found while loading, at a line of the text."""

    def __init__(self, line: int, msg: str) -> None:
        super().__init__(f"line {line}: {msg}")


def _line(node_or_event) -> int:
    return node_or_event.start_mark.line + 1


_MERGE = "tag:yaml.org,2002:merge"
_SURROGATE = re.compile("[\ud800-\udfff]")
_INT_DIGITS = {10: "0123456789", 16: "0123456789abcdefABCDEF", 8: "01234567"}


class _JobLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader with YAML 1.2 core-schema scalars and only the plain tags (str, int,
    float, bool, null, seq, map; any other tag is an error, none runs code), refusing duplicate
    keys, keys that are not non-empty text, nesting deeper than MAX_DEPTH and merges (`<<`)
    that copy more than MAX_ITEMS pairs. Merged keys are deduplicated as they are merged, so
    nested merges cannot grow exponentially."""

    yaml_implicit_resolvers: dict = {}
    yaml_constructors: dict = {}
    yaml_multi_constructors: dict = {}

    def __init__(self, text: str, name: str) -> None:
        try:
            super().__init__(text)
        except ReaderError as e:  # a character YAML does not allow
            e.name = name
            raise
        self.name = name  # marks in PyYAML's messages name the file
        self._depth = 0
        self._merged_pairs = 0
        self._flattening: set[int] = set()

    # composing: bounded nesting (the composer recurses once per level)
    def compose_node(self, parent, index):
        if self._depth >= MAX_DEPTH and not self.check_event(AliasEvent):
            raise _LoadError(_line(self.peek_event()), f"nested more than {MAX_DEPTH} levels deep")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    # mappings: text keys, no duplicates, merges without blow-up
    def _key(self, key_node) -> str:
        key = self.construct_object(key_node)
        if not isinstance(key, str):
            kinds = {bool: "a boolean", int: "a number", float: "a number", list: "a list"}
            kind = "null" if key is None else kinds.get(type(key), "a mapping")
            shown = "null" if key is None else echo(key)
            raise _LoadError(
                _line(key_node),
                f"key {shown} is {kind}, not text (keys are names such as 'sampling'; "
                "quote a key to make it text)",
            )
        if not key:
            raise _LoadError(_line(key_node), "empty key")
        return key

    def construct_mapping(self, node, deep=False):
        if not isinstance(node, MappingNode):
            raise ConstructorError(
                None, None, f"expected a mapping node, but found {node.id}", node.start_mark
            )
        self.flatten_mapping(node)
        mapping = {}
        for key_node, value_node in node.value:
            mapping[self._key(key_node)] = self.construct_object(value_node, deep=deep)
        return mapping

    def _check_keys(self, node) -> None:
        """Every key of the mapping is non-empty text, none twice (one merge key at most)."""
        first: dict[str, int] = {}
        for key_node, _ in node.value:
            key = "<<" if key_node.tag == _MERGE else self._key(key_node)
            if key in first:
                raise _LoadError(
                    _line(key_node), f"duplicate key {echo(key)} (first at line {first[key]})"
                )
            first[key] = _line(key_node)

    def flatten_mapping(self, node):
        """Checks the mapping's keys, then resolves merge keys in place like PyYAML (the
        mapping's own keys win over merged ones, earlier merged mappings over later ones),
        keeping one pair per key."""
        self._check_keys(node)
        if not any(k.tag == _MERGE for k, _ in node.value):
            return
        if id(node) in self._flattening:
            raise _LoadError(_line(node), "a merge key (<<) merges a mapping into itself")
        self._flattening.add(id(node))
        try:
            merged, own = [], []
            for key_node, value_node in node.value:
                if key_node.tag != _MERGE:
                    own.append((key_node, value_node))
                    continue
                if isinstance(value_node, MappingNode):
                    sources = [value_node]
                elif isinstance(value_node, SequenceNode):
                    sources = value_node.value
                else:
                    sources = [None]
                for src in sources:
                    if not isinstance(src, MappingNode):
                        raise _LoadError(
                            _line(key_node),
                            "a merge key (<<) takes a mapping or a list of mappings",
                        )
                    self.flatten_mapping(src)
                    self._merged_pairs += len(src.value)
                    if self._merged_pairs > MAX_ITEMS:
                        raise _LoadError(
                            _line(key_node),
                            f"merge keys (<<) copy more than {MAX_ITEMS:,} keys",
                        )
                for src in reversed(sources):
                    merged.extend(src.value)
            kept, seen = [], set()
            for key_node, value_node in reversed(merged + own):  # the last pair of a key wins
                ident = (
                    (key_node.tag, key_node.value)
                    if isinstance(key_node, ScalarNode)
                    else id(key_node)
                )
                if ident not in seen:
                    seen.add(ident)
                    kept.append((key_node, value_node))
            kept.reverse()
            node.value = kept
        finally:
            self._flattening.discard(id(node))

    # scalars
    def construct_job_str(self, node) -> str:
        value = self.construct_scalar(node)
        if _SURROGATE.search(value):
            raise _LoadError(_line(node), "text holds a lone surrogate (an invalid \\u escape)")
        return value

    def construct_job_int(self, node) -> int:
        text = self.construct_scalar(node)
        s = text.replace("_", "")
        sign = -1 if s.startswith("-") else 1
        body = s[1:] if s.startswith(("-", "+")) else s
        base = {"0x": 16, "0o": 8}.get(body[:2], 10)
        if base != 10:
            body = body[2:]
        if not body or any(c not in _INT_DIGITS[base] for c in body):
            raise _LoadError(_line(node), f"{echo(text)} is not an integer")
        if len(body) > 300:
            raise _LoadError(_line(node), f"integer {echo(text)} is far too large")
        return sign * int(body, base)

    def construct_job_float(self, node) -> float:
        text = self.construct_scalar(node)
        s = text.replace("_", "")
        special = {".inf": "inf", "+.inf": "inf", "-.inf": "-inf", ".nan": "nan"}
        try:
            return float(special.get(s.lower(), s))
        except ValueError:
            raise _LoadError(_line(node), f"{echo(text)} is not a number") from None

    def construct_job_bool(self, node) -> bool:
        text = self.construct_scalar(node)
        if text.lower() not in ("true", "false"):
            raise _LoadError(_line(node), f"{echo(text)} is not a boolean (true or false)")
        return text.lower() == "true"


for _tag, _pattern, _first in [
    ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    ("bool", r"true|True|TRUE|false|False|FALSE", list("tTfF")),
    ("int", r"[-+]?[0-9][0-9_]*|0o[0-7][0-7_]*|0x[0-9a-fA-F][0-9a-fA-F_]*", list("-+0123456789")),
    (
        "float",
        r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
        list("-+.0123456789"),
    ),
    ("merge", r"<<", ["<"]),
]:
    _JobLoader.add_implicit_resolver(
        f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?:{_pattern})$"), _first
    )
for _tag, _constructor in [
    ("null", SafeConstructor.construct_yaml_null),
    ("bool", _JobLoader.construct_job_bool),
    ("int", _JobLoader.construct_job_int),
    ("float", _JobLoader.construct_job_float),
    ("str", _JobLoader.construct_job_str),
    ("seq", SafeConstructor.construct_yaml_seq),
    ("map", SafeConstructor.construct_yaml_map),
]:
    _JobLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _constructor)
_JobLoader.add_constructor(None, SafeConstructor.construct_undefined)


def _clip_lines(text: str, width: int = 200, lines: int = 20) -> str:
    """A message of at most `lines` lines of at most `width` characters."""
    out = [ln if len(ln) <= width else ln[:width] + " ...(cut)" for ln in text.splitlines()]
    if len(out) > lines:
        out = out[:lines] + [f"... ({len(out) - lines} more lines)"]
    return "\n".join(out)


def _check_expansion(data: Any, source: str) -> None:
    """Refuses data that walks to more than MAX_ITEMS items or MAX_TEXT_CHARS characters of
    text, a shared value (a YAML alias) counted each time it is reached: an alias bomb (a
    list of aliases of a list of aliases ...) is small as a file and as loaded data, but
    validating, echoing or storing it would expand every reference."""
    items = chars = 0
    stack = [data]
    while stack:
        obj = stack.pop()
        if isinstance(obj, str):
            chars += len(obj)
            if chars > MAX_TEXT_CHARS:
                raise JobError(
                    f"{source}: the job expands to more than {MAX_TEXT_CHARS:,} characters of "
                    "text (aliases *name repeat what their anchor &name holds)"
                )
            continue
        if isinstance(obj, dict):
            items += 2 * len(obj)
        elif isinstance(obj, list):
            items += len(obj)
        else:
            continue
        if items > MAX_ITEMS:
            raise JobError(
                f"{source}: the job expands to more than {MAX_ITEMS:,} keys and values (aliases "
                "*name repeat what their anchor &name holds; a job needs a few dozen)"
            )
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        else:
            stack.extend(obj)


def load_yaml(text: str, source: str) -> Any:
    """Parses one YAML document of a job (the file, or a `--set` value) with the strict loader
    and bounds what it expands to. Raises JobError naming `source` and the line."""
    try:
        loader = _JobLoader(text, source)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except _LoadError as e:
        raise JobError(f"{source}: {_clip_lines(str(e))}") from None
    except yaml.YAMLError as e:
        raise JobError(f"{source}: not valid YAML: {_clip_lines(str(e))}") from None
    except RecursionError:
        raise JobError(f"{source}: not valid YAML: nested too deeply") from None
    _check_expansion(data, source)
    return data


def read_job_text(path: Path) -> str:
    """The job file's text: a readable file (not a directory) of UTF-8 text of at most
    MAX_JOB_FILE_BYTES (a byte order mark is skipped)."""
    try:
        if path.is_dir():
            raise JobError(f"job file {path} is a directory, not a YAML file")
        with open(path, "rb") as f:  # a FIFO or /dev/stdin works too: read only what is needed
            raw = f.read(MAX_JOB_FILE_BYTES + 1)
    except OSError as e:
        raise JobError(f"cannot read job file {path}: {e.strerror or e}") from None
    if len(raw) > MAX_JOB_FILE_BYTES:
        raise JobError(
            f"job file {path} is larger than {MAX_JOB_FILE_BYTES // (1 << 20)} MiB: "
            "a job file holds a few dozen keys (is it the right file?)"
        )
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise JobError(
            f"job file {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}, "
            f"line {line}: {e.reason})"
        ) from None


