"""Requests that do not decode: which field, so the caller's error can name it.

protobuf's parser says only "Error parsing message ... String field had bad UTF-8". This walks the
wire format (varint tags; length-delimited payloads; fixed 32/64-bit values) along the message's
descriptor and returns the path of the first string field whose bytes are not UTF-8
(`messages[1].role`, `sampling.stop[0]`), or None when the bytes are malformed some other way.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

MAX_DEPTH = 32  # protobuf's own recursion limit is 100; our messages nest 3 deep


def bad_utf8_field(desc: Descriptor, data: bytes) -> str | None:
    try:
        return _walk(desc, memoryview(data), "", 0)
    except (IndexError, ValueError):
        return None


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _walk(desc: Descriptor, buf: memoryview, prefix: str, depth: int) -> str | None:
    if depth > MAX_DEPTH:
        return None
    seen: dict[int, int] = {}  # field number -> occurrences so far (the index of a repeated field)
    i = 0
    while i < len(buf):
        tag, i = _varint(buf, i)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, i = _varint(buf, i)
            continue
        if wire == 1:
            i += 8
            continue
        if wire == 5:
            i += 4
            continue
        if wire != 2:
            return None  # groups or garbage
        n, i = _varint(buf, i)
        payload = buf[i:i + n]
        if len(payload) != n:
            return None
        i += n
        field = desc.fields_by_number.get(number)
        if field is None:
            continue
        k = seen.get(number, 0)
        seen[number] = k + 1
        name = prefix + field.name + (f"[{k}]" if _repeated(field) else "")
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                bytes(payload).decode("utf-8")
            except UnicodeDecodeError:
                return name
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            found = _walk(field.message_type, payload, name + ".", depth + 1)
            if found:
                return found
    return None


def _repeated(field: FieldDescriptor) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.28; `label` is deprecated there
    if is_repeated is not None:
        return bool(is_repeated)
    return field.label == FieldDescriptor.LABEL_REPEATED
