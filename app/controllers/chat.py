"""`ChatController`: the chat window's state: conversations (kept on disk), the streaming answer, stop, regenerate."""

from PySide6.QtCore import QObject, Signal

from app.clients.engine_client import ChatStream, EngineClient
from app.controllers.conversations import Conversation, ConversationStore, Message, title_from
from app.settings import Sampling


def speed_line(info: dict) -> str:
    """`42 tokens at 31.5 tok/s, prompt 120 tokens at 850 tok/s` from the response's timings (or usage)."""
    t = info.get("timings") or {}
    u = info.get("usage") or {}
    parts = []
    n = t.get("predicted_n", u.get("completion_tokens"))
    if n is not None:
        rate = t.get("predicted_per_second")
        parts.append(f"{n} tokens" + (f" at {rate:.1f} tok/s" if rate else ""))
    p = t.get("prompt_n", u.get("prompt_tokens"))
    if p is not None:
        rate = t.get("prompt_per_second")
        parts.append(f"prompt {p} tokens" + (f" at {rate:.0f} tok/s" if rate else ""))
    if info.get("finish_reason") == "length":
        parts.append("cut at the token limit")
    return ", ".join(parts)


class ChatController(QObject):
    conversationChanged = Signal()
    """The current conversation was replaced or its messages added/removed: show it again."""
    messageUpdated = Signal(int)
    """The text of message i grew (streaming)."""
    listChanged = Signal(list)
    busyChanged = Signal(bool)
    error = Signal(str)

    def __init__(
        self,
        client: EngineClient,
        store: ConversationStore,
        system_prompt: str = "",
        sampling: Sampling | None = None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.client = client
        self.store = store
        self.default_system_prompt = system_prompt
        self.default_sampling = sampling or Sampling()
        self.conversations: list[Conversation] = []
        self.current = self._blank()
        self._stream: ChatStream | None = None

    # -- conversations -----------------------------------------------------------------------------------------

    def _blank(self) -> Conversation:
        return Conversation(system_prompt=self.default_system_prompt, sampling=self.default_sampling)

    @property
    def busy(self) -> bool:
        return self._stream is not None

    def refresh_list(self) -> None:
        self.conversations = self.store.list()
        for problem in self.store.problems:
            self.error.emit(problem)
        self.listChanged.emit(self.conversations)

    def new_conversation(self) -> None:
        self.stop()
        self.current = self._blank()
        self.conversationChanged.emit()

    def open(self, conv_id: str) -> None:
        if conv_id == self.current.id:
            return
        self.stop()
        try:
            self.current = self.store.load(conv_id)
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.error.emit(f"conversation {conv_id} cannot be read ({e}): it may have been deleted")
            return
        self.conversationChanged.emit()

    def delete(self, conv_id: str) -> None:
        if conv_id == self.current.id:
            self.stop()
            self.current = self._blank()
            self.conversationChanged.emit()
        self.store.delete(conv_id)
        self.refresh_list()

    def set_system_prompt(self, text: str) -> None:
        self.current.system_prompt = text
        self._save_if_started()

    def set_sampling(self, sampling: Sampling) -> None:
        self.current.sampling = sampling
        self._save_if_started()

    def last_reply(self) -> str:
        for m in reversed(self.current.messages):
            if m.role == "assistant":
                return m.content
        return ""

    def transcript(self) -> str:
        """The whole conversation as markdown (for copying)."""
        names = {"user": "You", "assistant": "Assistant"}
        return "\n\n".join(f"**{names.get(m.role, m.role)}:**\n\n{m.content}" for m in self.current.messages)

    def _save_if_started(self) -> None:
        if self.current.messages:
            self._save()

    def _save(self) -> None:
        try:
            self.store.save(self.current)
        except OSError as e:
            self.error.emit(
                f"the conversation could not be saved to {self.store.root} ({e}): check free disk space"
            )
            return
        self.refresh_list()

    # -- asking ------------------------------------------------------------------------------------------------

    def send(self, text: str) -> bool:
        """Add the user's message and stream the answer. False (nothing sent) while an answer is streaming."""
        text = text.strip()
        if not text or self.busy:
            return False
        if not self.current.messages:
            self.current.title = title_from(text)
        self.current.messages.append(Message("user", text))
        self._ask()
        return True

    def regenerate(self) -> bool:
        """Drop the last answer and ask again."""
        if self.busy:
            return False
        msgs = self.current.messages
        while msgs and msgs[-1].role == "assistant":
            msgs.pop()
        if not msgs:
            return False
        self._ask()
        return True

    def stop(self) -> None:
        if self._stream is not None:
            self._stream.abort()

    def _ask(self) -> None:
        conv = self.current
        request = conv.request_messages()
        conv.messages.append(Message("assistant", ""))
        self.conversationChanged.emit()
        stream = self.client.chat(request, **conv.sampling.request_fields())
        index = len(conv.messages) - 1
        stream.delta.connect(lambda piece: self._on_delta(conv, index, piece))
        stream.finished.connect(lambda info: self._on_finished(conv, info))
        stream.failed.connect(lambda msg: self._on_failed(conv, msg))
        self._stream = stream
        self.busyChanged.emit(True)
        self._save()

    def _on_delta(self, conv: Conversation, index: int, piece: str) -> None:
        conv.messages[index].content += piece
        if conv is self.current:
            self.messageUpdated.emit(index)

    def _end(self, conv: Conversation, stats: str) -> None:
        self._stream = None
        answer = conv.messages[-1]
        answer.stats = stats
        self.busyChanged.emit(False)
        if conv is self.current:
            self.messageUpdated.emit(len(conv.messages) - 1)
        try:
            self.store.save(conv)
        except OSError as e:
            self.error.emit(
                f"the conversation could not be saved to {self.store.root} ({e}): check free disk space"
            )
        self.refresh_list()

    def _on_finished(self, conv: Conversation, info: dict) -> None:
        stats = speed_line(info)
        if info.get("stopped"):
            stats = "stopped" + (f" ({stats})" if stats else "")
        self._end(conv, stats)

    def _on_failed(self, conv: Conversation, message: str) -> None:
        """An answer that failed before any text came is not kept as a reply (the error goes to the status line;
        the question stays, to send again); one cut short keeps its text, marked with the error."""
        if conv.messages and conv.messages[-1].role == "assistant" and not conv.messages[-1].content:
            conv.messages.pop()
            self._stream = None
            self.busyChanged.emit(False)
            if conv is self.current:
                self.conversationChanged.emit()
            self._save_if_started()
        else:
            self._end(conv, f"error: {message}")
        self.error.emit(message)
