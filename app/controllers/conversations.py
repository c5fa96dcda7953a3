"""Chat conversations on disk: one JSON file per conversation under the platformdirs data dir (`conversations/`)."""

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.settings import Sampling
from installer.paths import data_dir

TITLE_CHARS = 60


@dataclass
class Message:
    role: str
    """system, user or assistant."""
    content: str
    stats: str = ""
    """For an answer: its speed line (tokens, tok/s), or why it ended early."""


@dataclass
class Conversation:
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    title: str = "New chat"
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    system_prompt: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    messages: list[Message] = field(default_factory=list)

    def request_messages(self) -> list[dict[str, str]]:
        """The messages sent to the engine: the system prompt, then every message with text."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []
        return out + [{"role": m.role, "content": m.content} for m in self.messages if m.content]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Conversation":
        return cls(
            id=str(data["id"]),
            title=str(data.get("title") or "New chat"),
            created=float(data.get("created") or 0.0),
            updated=float(data.get("updated") or 0.0),
            system_prompt=str(data.get("system_prompt") or ""),
            sampling=Sampling.from_dict(data.get("sampling") or {}),
            messages=[
                Message(str(m["role"]), str(m.get("content") or ""), str(m.get("stats") or ""))
                for m in data.get("messages") or []
            ],
        )


_MARKS = re.compile(r"(\*\*|__|`+|~~|^#+\s*|^>\s*|^[-*+]\s+)", re.MULTILINE)


def title_from(text: str) -> str:
    """A conversation's title from its first message: one line, without markdown marks (bold, code, headings,
    quotes, bullets), cut to TITLE_CHARS."""
    line = " ".join(_MARKS.sub("", text).split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


class ConversationStore:
    """Loads and saves conversations; a file that cannot be read is listed in `problems`, never fatal."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or data_dir() / "conversations"
        self.root.mkdir(parents=True, exist_ok=True)
        self.problems: list[str] = []

    def _path(self, conv_id: str) -> Path:
        return self.root / f"{conv_id}.json"

    def list(self) -> list[Conversation]:
        """Every readable conversation, the most recently updated first."""
        out, self.problems = [], []
        for path in self.root.glob("*.json"):
            try:
                out.append(Conversation.from_dict(json.loads(path.read_text(encoding="utf-8"))))
            except (OSError, ValueError, KeyError, TypeError) as e:
                self.problems.append(f"{path} cannot be read ({e}): it is skipped; delete or fix it")
        return sorted(out, key=lambda c: c.updated, reverse=True)

    def load(self, conv_id: str) -> Conversation:
        return Conversation.from_dict(json.loads(self._path(conv_id).read_text(encoding="utf-8")))

    def save(self, conv: Conversation) -> None:
        conv.updated = time.time()
        path = self._path(conv.id)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(conv.to_dict(), indent=1, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)

    def delete(self, conv_id: str) -> None:
        self._path(conv_id).unlink(missing_ok=True)
