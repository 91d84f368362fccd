"""Field names across the HTTP APIs: the Messages and Responses routes translate their body into
a chat-completions body, and an error the chat pipeline raises names a field of that body. A
`FieldNames` table names it back as the caller's own body does. Pure."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from edgespec.errors import BadRequest


@dataclass(frozen=True)
class FieldNames:
    """`renames`: (pattern, replacement) applied in order to a chat-body field; `system`: the name
    of what became a message the caller's list did not hold (a system prompt, instructions);
    `message`: the caller's name for its message i ("{}" the index). `origin[k]`: the caller's
    index of chat message k, -1 for one made from `system`."""

    renames: tuple[tuple[re.Pattern[str], str], ...]
    system: str
    message: str

    def name(self, name: str | None, origin: Sequence[int]) -> str | None:
        """A field of the translated chat body named as the caller's body names it."""
        if name is None:
            return None
        m = re.match(r"^messages\[(\d+)\]", name)
        if m:
            k = int(m.group(1))
            i = origin[k] if k < len(origin) else -1
            return self.system if i < 0 else self.message.format(i)
        for pattern, repl in self.renames:
            name = pattern.sub(repl, name)
        return name

    def renamed(self, exc: BadRequest, origin: Sequence[int]) -> BadRequest:
        """The chat pipeline's BadRequest with its field named as the caller's body names it."""
        name = self.name(exc.field, origin)
        if name is None or name == exc.field:
            return exc
        return type(exc)(name, str(exc).split(": ", 1)[-1])
