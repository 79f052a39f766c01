"""Text that UTF-8 cannot carry, found before it reaches protobuf, SQL or a log line.

Two ways such text arrives:

- JSON: `"\\ud800"` is valid JSON (RFC 8259 allows an escaped lone UTF-16 surrogate) and Python's
  `json` decodes it to a `str` holding a lone surrogate, which is not Unicode text: protobuf,
  SQLite and the UTF-8 codec refuse to encode it (UnicodeEncodeError). HTTP headers decoded with
  `surrogateescape` (aiohttp's) carry undecodable bytes the same way.
- protobuf's wire format: a string field whose bytes are not UTF-8, which the message parser
  refuses as a whole (DecodeError), without saying which field.

Each check returns the path of the first bad string in Sluice's field-path style
("messages[1].content", "sampling.stop[0]"), so that the refusal can name it; None when all is well.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor

# protobuf's own bound on nested messages; deeper input is refused by the parser anyway.
_MAX_DEPTH = 100


def is_valid_text(text: str) -> bool:
    """Whether `text` is Unicode that UTF-8 can encode (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable(text: str) -> str:
    """`text` with any lone surrogate written as its escape (\\ud800), safe to put in a message."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid_json_text(document: Any) -> str | None:
    """The path of the first string, object key included, in a parsed JSON document that is not
    valid Unicode; "" when the document itself is such a string. Iterative: a document as deep as
    `json.loads` accepts does not exhaust the stack here."""
    pending: list[tuple[str, Any]] = [("", document)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            if not is_valid_text(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else key
                if not is_valid_text(key):
                    return printable(child)
                pending.append((child, item))
        elif isinstance(value, list):
            pending.extend((f"{path}[{index}]", item) for index, item in enumerate(value))
    return None


def invalid_wire_text(descriptor: Descriptor, data: bytes) -> str | None:
    """The path of the first string field of a serialized `descriptor` message whose bytes are not
    UTF-8. None when there is none, or when the bytes are not a message at all (truncated, a
    wire type protobuf's parser refuses): the caller then refuses the message as a whole."""
    try:
        return _walk(descriptor, data, 0)
    except (IndexError, ValueError):
        return None


def _walk(descriptor: Descriptor, data: bytes, depth: int) -> str | None:
    if depth > _MAX_DEPTH:
        return None
    position = 0
    counts: dict[int, int] = {}
    while position < len(data):
        key, position = _varint(data, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, position = _varint(data, position)
            continue
        if wire_type in (1, 5):
            position += 8 if wire_type == 1 else 4
            continue
        if wire_type != 2:
            return None  # groups: no Sluice message has them
        length, position = _varint(data, position)
        chunk = data[position : position + length]
        position += length
        if len(chunk) != length:
            return None
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue
        index = counts.get(number, 0)
        counts[number] = index + 1
        name = f"{field.name}[{index}]" if field.is_repeated else field.name
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError:
                return name
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            inner = _walk(field.message_type, chunk, depth + 1)
            if inner is not None:
                return f"{name}.{inner}"
    return None


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")
