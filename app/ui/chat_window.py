"""The chat window: conversations on the left; the streamed answer rendered as markdown; stop, regenerate, copy;
system prompt and sampling settings. All state is in `ChatController`; this is the view."""

import html

from PySide6.QtCore import QEvent, QObject, Qt, QTimer, QUrl
from PySide6.QtGui import (
    QColor,
    QDesktopServices,
    QFont,
    QGuiApplication,
    QKeyEvent,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
)
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTextBrowser,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.controllers.chat import ChatController
from app.controllers.conversations import Message
from app.controllers.engine import EngineController, EngineState
from app.controllers.library import LibraryController
from app.settings import Sampling
from app.ui.icons import app_icon
from app.ui.markdown import code_html, hard_breaks, segments

ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}
ROLE_COLORS = {"user": "#3b6fb6", "assistant": "#2a7a3a", "system": "#777777"}
RENDER_MS = 50


class _EnterSends(QObject):
    """Enter sends, Shift+Enter starts a new line."""

    def __init__(self, send: object) -> None:
        super().__init__()
        self._send = send

    def eventFilter(self, obj: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.KeyPress and isinstance(event, QKeyEvent):
            if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
                event.modifiers() & Qt.KeyboardModifier.ShiftModifier
            ):
                self._send()  # type: ignore[operator]
                return True
        return False


class Transcript(QTextBrowser):
    """The conversation as one rich-text document; an answer that streams is re-rendered from its own start only."""

    def __init__(self) -> None:
        super().__init__()
        self.setOpenLinks(False)  # links open in the browser; "copy:N" copies code block N
        self.anchorClicked.connect(self._on_link)
        self._starts: list[int] = []
        self.codes: list[str] = []  # the code blocks shown, in order: what their "Copy code" links copy

    def _on_link(self, url: QUrl) -> None:
        if url.scheme() == "copy":
            n = int(url.path() or -1)
            if 0 <= n < len(self.codes):
                QGuiApplication.clipboard().setText(self.codes[n])
            return
        QDesktopServices.openUrl(url)

    def render_all(self, messages: list[Message]) -> None:
        self.clear()
        self._starts = []
        self.codes = []
        self._append(messages, 0)

    def render_from(self, messages: list[Message], index: int) -> None:
        if index >= len(self._starts) or len(self._starts) > len(messages):
            self.render_all(messages)
            return
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        cur = QTextCursor(self.document())
        # from the end of the previous message, so that its block break goes too and _append adds it back once
        cur.setPosition(max(self._starts[index] - 1, 0))
        cur.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cur.removeSelectedText()
        del self._starts[index:]
        self._append(messages, index)
        if at_bottom:
            bar.setValue(bar.maximum())

    def _append(self, messages: list[Message], first: int) -> None:
        cur = QTextCursor(self.document())
        cur.movePosition(QTextCursor.MoveOperation.End)
        for m in messages[first:]:
            if self._starts or cur.position() > 0:
                cur.insertBlock(QTextBlockFormat(), QTextCharFormat())
            self._starts.append(cur.position())
            head = QTextCharFormat()
            head.setFontWeight(QFont.Weight.Bold)
            head.setForeground(QColor(ROLE_COLORS.get(m.role, "#333")))
            block = QTextBlockFormat()
            block.setTopMargin(10)
            cur.setBlockFormat(block)
            cur.insertText(ROLE_NAMES.get(m.role, m.role), head)
            cur.insertBlock(QTextBlockFormat(), QTextCharFormat())
            if m.content:
                self._insert_answer(cur, m.content)
            elif not m.stats:
                cur.insertText("…", QTextCharFormat())
            if m.stats:
                cur.insertBlock(QTextBlockFormat(), QTextCharFormat())
                note = QTextCharFormat()
                note.setForeground(QColor("#b00020" if m.stats.startswith("error") else "#777777"))
                note.setFontItalic(True)
                cur.insertText(m.stats, note)
        self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())

    def _insert_answer(self, cur: QTextCursor, content: str) -> None:
        """Markdown with its line breaks kept; each fenced code block highlighted, with a "Copy code" link."""
        for n, (kind, language, body) in enumerate(segments(content)):
            if n:
                cur.insertBlock(QTextBlockFormat(), QTextCharFormat())
            if kind == "text":
                cur.insertMarkdown(hard_breaks(body))
                continue
            cur.insertHtml(code_html(body, language))
            cur.insertBlock(QTextBlockFormat(), QTextCharFormat())
            cur.insertHtml(f'<a href="copy:{len(self.codes)}" style="font-size:small">Copy code</a>')
            self.codes.append(body)


class SamplingBox(QGroupBox):
    def __init__(self, chat: ChatController) -> None:
        super().__init__()
        self.chat = chat
        form = QFormLayout(self)
        self.system = QPlainTextEdit()
        self.system.setPlaceholderText("System prompt (optional), e.g. “Answer briefly.”")
        self.system.setMaximumHeight(70)
        form.addRow("System prompt:", self.system)
        grid = QGridLayout()  # two rows of three: one long row made the window squeeze the conversation list
        self.temperature = self._dspin(0.0, 2.0, 0.05)
        self.top_p = self._dspin(0.0, 1.0, 0.01)
        self.min_p = self._dspin(0.0, 1.0, 0.01)
        self.top_k = QSpinBox()
        self.top_k.setRange(0, 1000)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 1 << 20)
        self.seed = QLineEdit()
        self.seed.setPlaceholderText("random")
        self.seed.setFixedWidth(80)
        for n, (label, w) in enumerate(
            (
                ("temperature", self.temperature),
                ("top-p", self.top_p),
                ("top-k", self.top_k),
                ("min-p", self.min_p),
                ("max tokens", self.max_tokens),
                ("seed", self.seed),
            )
        ):
            grid.addWidget(QLabel(label), n // 3, 2 * (n % 3))
            grid.addWidget(w, n // 3, 2 * (n % 3) + 1)
        grid.setColumnStretch(6, 1)
        form.addRow("Sampling:", grid)
        self.load()
        self.system.textChanged.connect(lambda: chat.set_system_prompt(self.system.toPlainText()))
        for w in (self.temperature, self.top_p, self.min_p, self.top_k, self.max_tokens):
            w.valueChanged.connect(self._apply)
        self.seed.editingFinished.connect(self._apply)

    @staticmethod
    def _dspin(lo: float, hi: float, step: float) -> QDoubleSpinBox:
        w = QDoubleSpinBox()
        w.setRange(lo, hi)
        w.setSingleStep(step)
        w.setDecimals(2)
        return w

    def load(self) -> None:
        c = self.chat.current
        widgets = (
            self.system,
            self.temperature,
            self.top_p,
            self.min_p,
            self.top_k,
            self.max_tokens,
            self.seed,
        )
        for w in widgets:
            w.blockSignals(True)
        s = c.sampling
        self.system.setPlainText(c.system_prompt)
        self.temperature.setValue(s.temperature)
        self.top_p.setValue(s.top_p)
        self.min_p.setValue(s.min_p)
        self.top_k.setValue(s.top_k)
        self.max_tokens.setValue(s.max_tokens)
        self.seed.setText("" if s.seed is None else str(s.seed))
        for w in widgets:
            w.blockSignals(False)

    def _apply(self) -> None:
        text = self.seed.text().strip()
        seed = int(text) if text.lstrip("-").isdigit() else None
        if text and seed is None:
            self.seed.setText("")
        self.chat.set_sampling(
            Sampling(
                temperature=self.temperature.value(),
                top_p=self.top_p.value(),
                top_k=self.top_k.value(),
                min_p=self.min_p.value(),
                max_tokens=self.max_tokens.value(),
                seed=seed,
            )
        )


class ChatWindow(QMainWindow):
    def __init__(
        self,
        chat: ChatController,
        engine: EngineController,
        library: LibraryController | None = None,
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.chat = chat
        self.engine = engine
        self.setWindowTitle("PolyStrata chat")
        self.setWindowIcon(app_icon())

        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(chat.new_conversation)
        self.conv_list = QListWidget()
        self.conv_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conv_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.conv_list.itemClicked.connect(lambda item: chat.open(item.data(Qt.ItemDataRole.UserRole)))
        self.delete_button = QPushButton("Delete")
        self.delete_button.clicked.connect(self._delete_selected)
        ll.addWidget(self.new_button)
        ll.addWidget(self.conv_list, 1)
        ll.addWidget(self.delete_button)

        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        banner_row = QHBoxLayout()
        self.banner = QLabel()
        self.banner.setWordWrap(True)
        self.start_button = QPushButton("Start the engine")
        self.start_button.clicked.connect(engine.start)
        banner_row.addWidget(self.banner, 1)
        banner_row.addWidget(self.start_button)
        # the model picker: the models on this PC; choosing one restarts the engine on it
        self.library = library
        self.model_picker = QComboBox()
        self.model_picker.setToolTip("The model to chat with: the engine restarts on the one chosen")
        self.model_picker.activated.connect(self._pick_model)
        banner_row.addWidget(self.model_picker)
        if library is not None:
            library.changed.connect(self._fill_models)
        self._fill_models()
        self.transcript = Transcript()
        self.settings_toggle = QToolButton()
        self.settings_toggle.setText("System prompt and sampling")
        self.settings_toggle.setCheckable(True)
        self.settings_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.settings_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.sampling = SamplingBox(chat)
        self.sampling.hide()
        self.settings_toggle.toggled.connect(self._toggle_settings)
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Message (Enter sends, Shift+Enter for a new line)")
        self.input.setMaximumHeight(90)
        self._enter = _EnterSends(self.send)
        self.input.installEventFilter(self._enter)
        buttons = QHBoxLayout()
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.stop_button = QPushButton("Stop")
        self.regen_button = QPushButton("Regenerate")
        self.copy_button = QPushButton("Copy answer")
        self.copy_all_button = QPushButton("Copy chat")
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(chat.stop)
        self.regen_button.clicked.connect(chat.regenerate)
        self.copy_button.clicked.connect(lambda: QGuiApplication.clipboard().setText(chat.last_reply()))
        self.copy_all_button.clicked.connect(lambda: QGuiApplication.clipboard().setText(chat.transcript()))
        self.status = QLabel("")
        self.status.setWordWrap(True)
        self.status.setStyleSheet("color: #b00020;")
        for b in (self.send_button, self.stop_button, self.regen_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(self.copy_button)
        buttons.addWidget(self.copy_all_button)
        rl.addLayout(banner_row)
        rl.addWidget(self.transcript, 1)
        rl.addWidget(self.settings_toggle)
        rl.addWidget(self.sampling)
        rl.addWidget(self.input)
        rl.addLayout(buttons)
        rl.addWidget(self.status)

        left.setMinimumWidth(170)
        splitter = QSplitter()
        splitter.addWidget(left)
        splitter.addWidget(right)
        splitter.setCollapsible(0, False)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([220, 680])
        body = QWidget()
        bl = QVBoxLayout(body)
        bl.addWidget(splitter)
        self.setCentralWidget(body)
        self.resize(960, 680)

        self._dirty_from: int | None = None
        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.timeout.connect(self._render_pending)
        chat.conversationChanged.connect(self._on_conversation)
        chat.messageUpdated.connect(self._on_message)
        chat.listChanged.connect(self._on_list)
        chat.busyChanged.connect(lambda _b: self._update_buttons())
        chat.error.connect(self.status.setText)
        engine.stateChanged.connect(lambda _s: (self._update_banner(), self._update_buttons()))
        chat.refresh_list()
        self._on_conversation()
        self._update_banner()

    def _fill_models(self) -> None:
        lib = self.library
        self.model_picker.blockSignals(True)
        self.model_picker.clear()
        models = lib.models if lib is not None else []
        for m in models:
            self.model_picker.addItem(m.name, str(m.path))
            if lib is not None and lib.served is not None and m.path == lib.served:
                self.model_picker.setCurrentIndex(self.model_picker.count() - 1)
        self.model_picker.setVisible(bool(models))
        self.model_picker.blockSignals(False)

    def _pick_model(self, index: int) -> None:
        lib = self.library
        if lib is None or not 0 <= index < len(lib.models):
            return
        m = lib.models[index]
        if lib.served is None or m.path != lib.served:
            lib.serve(m)

    def send(self) -> None:
        if not self.send_button.isEnabled():  # Enter in the input while the engine cannot answer
            return
        if self.chat.send(self.input.toPlainText()):
            self.input.clear()
            self.status.clear()

    def _toggle_settings(self, on: bool) -> None:
        self.sampling.setVisible(on)
        self.settings_toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)

    def _delete_selected(self) -> None:
        item = self.conv_list.currentItem()
        if item is not None:
            self.chat.delete(item.data(Qt.ItemDataRole.UserRole))

    def _on_conversation(self) -> None:
        self._dirty_from = None
        self.transcript.render_all(self.chat.current.messages)
        self.sampling.load()
        self._select_current()
        self._update_buttons()

    def _on_message(self, index: int) -> None:
        self._dirty_from = index if self._dirty_from is None else min(self._dirty_from, index)
        if not self._render_timer.isActive():
            self._render_timer.start(RENDER_MS)

    def _render_pending(self) -> None:
        if self._dirty_from is not None:
            self.transcript.render_from(self.chat.current.messages, self._dirty_from)
            self._dirty_from = None

    def _on_list(self, conversations: list) -> None:
        self.conv_list.blockSignals(True)
        self.conv_list.clear()
        for c in conversations:
            item = QListWidgetItem(c.title)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            item.setToolTip(c.title)
            self.conv_list.addItem(item)
        self.conv_list.blockSignals(False)
        self._select_current()

    def _select_current(self) -> None:
        for i in range(self.conv_list.count()):
            item = self.conv_list.item(i)
            if item.data(Qt.ItemDataRole.UserRole) == self.chat.current.id:
                self.conv_list.setCurrentItem(item)
                return
        self.conv_list.clearSelection()

    def _update_buttons(self) -> None:
        busy = self.chat.busy
        has_messages = bool(self.chat.current.messages)
        # only an engine that answers takes a question (the banner says why not and offers to start it)
        answers = self.engine.state in (EngineState.READY, EngineState.DEGRADED)
        self.send_button.setEnabled(not busy and answers)
        self.stop_button.setEnabled(busy)
        self.regen_button.setEnabled(not busy and has_messages and answers)
        self.copy_button.setEnabled(has_messages)
        self.copy_all_button.setEnabled(has_messages)

    def _update_banner(self) -> None:
        state = self.engine.state
        if state == EngineState.READY:
            self.banner.setText(
                f"Model: <b>{html.escape(self.engine.model_name)}</b> · {self.engine.api_url}"
            )
            self.banner.setStyleSheet("")
            self.start_button.hide()
        else:
            texts = {
                EngineState.STARTING: "The engine is starting…",
                EngineState.LOADING: "The engine is loading the model…",
                EngineState.STOPPING: "The engine is stopping.",
                EngineState.ERROR: f"The engine reports an error: {self.engine.message}",
                EngineState.DEGRADED: f"A worker PC does not answer: {self.engine.message}",
                EngineState.CRASHED: f"The engine stopped: {self.engine.message}",
            }
            self.banner.setText(html.escape(texts.get(state, "The engine is not running: start it to chat.")))
            self.banner.setStyleSheet("background: #fff4d6; padding: 6px; border-radius: 4px;")
            self.start_button.setVisible(not self.engine.running and state != EngineState.STOPPING)
