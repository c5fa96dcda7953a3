"""`strata-node tune`: measure layer splits across PCs and prompt chunk sizes for real, and keep the best.

For every candidate split the tuner makes sure each worker PC holds the layers it needs (shipped once, one file per
PC covering every candidate's range), starts the workers through the agents (the last first, a relay's key made
ahead so the stage after it admits it), and loads the main stage here the way `strata-engine` does: the candidate
config goes through the engine's own option rules (`installer.engine_options`). Then for every chunk size it reads
its own fixed prompts (the same token ids every time, no prompt cache) of the workload's lengths and answers of
fixed length, and takes the generation stream's own timings. The best
configuration is the one with the least expected time per request over the workload mix; the config is written in
installer/config.py's format and every measurement goes into a report table. A Windows worker PC whose GPU clocks
are not locked is named in a warning (Windows lowers an idle worker GPU's clocks between decode steps).
"""

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engine.gguf.reader import GGUFFile
from engine.layers.kv_cache import resolve_kv_type
from engine.link.startup import load_split_model
from engine.node.chain import ChainError, Link, engine_flags, start_chain, stop_chain, wait_listening
from engine.node.client import (
    NodeClient,
    NodeError,
    NodeRecord,
    NodeRegistry,
    main_dir,
    main_keys,
)
from engine.node.errors import NodeCliError
from engine.node.keys import KeyPair
from engine.node.shard import ShardLayout
from engine.node.shipper import ship
from engine.node.tune_defaults import DEFAULT_ANSWER, DEFAULT_MIX
from engine.pipeline.generate import DoneEvent, GenerationRequest, Runner
from engine.pipeline.split import prefill_span
from engine.pipeline.split_args import options_from_args
from engine.tokenizer import Tokenizer
from installer.config import ConfigError, StrataConfig, Worker, config_path, read_config, write_config
from installer.config import config_path as default_config_path
from installer.engine_options import from_config, merge, typed

MIN_LAYERS_PER_STAGE = 3

# The tuner's own text: plain prose, tokenized with the model's tokenizer and repeated to the length wanted.
_TEXT = (
    "The survey ship left the inner harbour before dawn and followed the coast north for three days. "
    "Each evening the crew wrote down the depth of the channel, the colour of the water, the direction of the "
    "wind and the birds that followed the wake. On the fourth morning the cliffs gave way to a wide bay with a "
    "river mouth at its far end, and the captain ordered the boats lowered to sound the bar. The river carried "
    "silt far into the bay, so the soundings changed from one tide to the next, and the map had to be drawn "
    "twice. In the afternoon a fishing village came into view on the southern shore; its people traded dried "
    "fish and fresh water for rope and iron nails, and told the crew about a second channel hidden behind the "
    "islands to the east. "
)


class TuneError(NodeCliError, RuntimeError):
    """The tuner cannot go on; the message says what failed and what to do."""


@dataclass(frozen=True)
class Measurement:
    split: tuple[int, ...]
    chunk: int
    prompt_tokens: int
    answer_tokens: int
    prefill_tps: float
    decode_tps: float
    seconds: float
    error: str = ""


@dataclass
class TuneResult:
    best_split: tuple[int, ...] | None
    best_chunk: int | None
    best_seconds: float | None
    measurements: list[Measurement]
    scores: dict[str, float]
    warnings: list[str]
    config_path: Path | None = None
    report_path: Path | None = None
    workload: list[tuple[int, float]] = field(default_factory=list)


def workload(
    max_context: int, answer: int, mix: Sequence[tuple[int, float]] = DEFAULT_MIX
) -> list[tuple[int, float]]:
    """The mix's prompt lengths scaled so that the longest prompt plus its answer fits `max_context`."""
    longest = max(length for length, _ in mix)
    room = max_context - answer - 8
    if room < 16:
        raise TuneError(
            f"--max-context {max_context} leaves no room for prompts with {answer}-token answers: raise it or "
            "lower --answer-tokens"
        )
    scale = min(1.0, room / longest)
    total = sum(w for _, w in mix)
    return [(max(16, round(length * scale)), w / total) for length, w in mix]


def candidate_splits(
    n_layer: int, stages: int, count: int = 5, min_layers: int = MIN_LAYERS_PER_STAGE
) -> list[tuple[int, ...]]:
    """Up to `count` splits of n_layer layers into `stages` contiguous ranges (the first layer of each later stage),
    centred on the even split and spread around it, each stage with at least `min_layers` layers."""
    min_layers = max(1, min(min_layers, n_layer // stages))
    even = tuple(round(n_layer * i / stages) for i in range(1, stages))
    step = max(1, n_layer // 16)
    found: list[tuple[int, ...]] = []

    def ok(s: tuple[int, ...]) -> bool:
        bounds = (0, *s, n_layer)
        return all(b - a >= min_layers for a, b in itertools.pairwise(bounds))

    offsets = sorted(itertools.product(range(-2, 3), repeat=stages - 1), key=lambda o: (sum(map(abs, o)), o))
    for off in offsets:
        s = tuple(e + o * step for e, o in zip(even, off, strict=True))
        if ok(s) and s not in found:
            found.append(s)
        if len(found) >= count:
            break
    if not found:
        raise TuneError(
            f"{n_layer} layers cannot be cut into {stages} stages of at least {min_layers} layers: use fewer PCs"
        )
    return found


def parse_splits(texts: Sequence[str], n_layer: int, stages: int) -> list[tuple[int, ...]]:
    out = []
    for t in texts:
        parts = [p.strip() for p in t.split(",")]
        if not all(p.isdigit() for p in parts) or len(parts) != stages - 1:
            raise TuneError(
                f"split {t!r}: give {stages - 1} first-layer number(s) separated by commas (one per worker PC), "
                "e.g. 24 or 24,40"
            )
        s = tuple(int(p) for p in parts)
        if not all(a < b for a, b in itertools.pairwise((0, *s))) or s[-1] >= n_layer:
            raise TuneError(f"split {t!r}: numbers must rise and stay below the model's {n_layer} layers")
        out.append(s)
    return out


def fixed_prompt(tokenizer: Any, n: int) -> list[int]:
    """The tuner's prompt of exactly n tokens: its text tokenized once and repeated."""
    ids = tokenizer.encode(_TEXT, add_special=False, parse_special=False)
    if not ids:
        raise TuneError("the model's tokenizer turns the tuner's text into no tokens")
    reps = -(-n // len(ids))
    return (ids * reps)[:n]


def expected_seconds(rows: list[Measurement], mix: list[tuple[int, float]]) -> float | None:
    """Weighted time per request over the mix, from one configuration's measurements (None if any failed)."""
    by_len = {r.prompt_tokens: r for r in rows}
    total = 0.0
    for length, w in mix:
        r = by_len.get(length)
        if r is None or r.error:
            return None
        total += w * r.seconds
    return total


# ---------------------------------------------------------------------------------------------------------------
# The main stage


class MainStage:
    """The main process's stage of one candidate, loaded in this process from the candidate config through the
    engine's flags and option parser (what `strata-engine` does with the same config)."""

    def __init__(self, config: Any, key_flags: list[str], device: str, dtype: str) -> None:
        # What `strata-engine generate --config C` would run: the config, then the flags given here.
        given = {**typed(["generate", "--prompt", "-", *key_flags]), "device": device, "dtype": dtype}
        from_file, _ = from_config(config, "generate")
        args, _ = merge("generate", given, from_file)
        opts = options_from_args(args)
        self.lm = load_split_model(config.model, opts, args.max_context, args.kv, args.dtype)
        self.max_context = self.lm.context  # --max-context, auto resolved at load
        self.kv_type = resolve_kv_type(args.kv, self.lm.model.dtype)
        self._span_room = (opts.vram_budget_mib, opts.reserve_mib)  # spans sized as the server sizes them

    def measure(self, prompt: list[int], answer: int, chunk: int) -> tuple[float, float, float]:
        """(prefill tok/s, decode tok/s, seconds) of one request with a fresh KV cache."""
        m = self.lm.model
        span = prefill_span(m, chunk, self.max_context, self.kv_type, *self._span_room)
        runner = Runner(m, self.lm.tokenizer, self.max_context, self.kv_type, chunk, prefill_span=span)
        req = GenerationRequest(prompt, max_tokens=answer, ignore_eos=True, cache_prompt=False)
        for ev in runner.generate(req):
            if isinstance(ev, DoneEvent):
                t = ev.timings
                if t.generated_tokens != answer:
                    raise TuneError(f"the answer stopped after {t.generated_tokens} of {answer} tokens")
                return t.prompt_per_second, t.generated_per_second, (t.prompt_ms + t.generated_ms) / 1000.0
        raise TuneError("the generation ended without its timings")

    def close(self) -> None:
        close = getattr(self.lm.model, "close", None)
        if callable(close):
            close()
        self.lm.gguf.close()


# ---------------------------------------------------------------------------------------------------------------


class Tuner:
    def __init__(
        self,
        model: Path,
        nodes: list[NodeRecord],
        splits: list[tuple[int, ...]] | None = None,
        chunks: Sequence[int] = (),
        mix: Sequence[tuple[int, float]] = DEFAULT_MIX,
        answer_tokens: int = DEFAULT_ANSWER,
        max_context: int | None = None,
        worker_flags: Sequence[str] = (),
        lock_clocks: bool = False,
        keys: KeyPair | None = None,
        log: Any = None,
        device: str = "auto",
        dtype: str = "auto",
        base: Any = None,
        progress: Any = None,
    ) -> None:
        if not nodes:
            raise TuneError(
                "no worker PC to tune with: pair one (strata-node pair) or include one (strata-node include)"
            )
        self.model = Path(model)
        self.records = nodes
        self.keys = keys or main_keys()
        self.lock_clocks = lock_clocks
        self.answer = answer_tokens
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.device, self.dtype = device, dtype
        self.base = base  # the model's config before tuning: its cards, KV type and args are kept
        # progress(what, done, total): "ship" in bytes per worker PC, "measure" in measurements of the whole run
        self.progress = progress or (lambda what, done, total: None)

        with GGUFFile.open(self.model) as gf:
            arch = gf.architecture
            n_layer = gf.get(f"{arch}.block_count")
            ctx = gf.get(f"{arch}.context_length")
            self.tokenizer = Tokenizer.from_metadata(gf.metadata)
        if not isinstance(n_layer, int):
            raise TuneError(
                f"{self.model.name} has no {arch}.block_count: it cannot be split into layer ranges"
            )
        self.n_layer = n_layer
        self.max_context = int(max_context or min(int(ctx) if isinstance(ctx, int) else 4096, 131072))
        self.mix = workload(self.max_context, self.answer, mix)
        stages = len(nodes) + 1
        self.splits = splits or candidate_splits(n_layer, stages)
        longest = max(length for length, _ in self.mix)
        self.chunks = sorted({min(c, longest) for c in chunks}) if chunks else _default_chunks(longest)
        self.worker_flags = list(worker_flags)
        self.measurements: list[Measurement] = []
        self.warnings: list[str] = []

    # -- steps ------------------------------------------------------------------------------------------------

    def _connect(self) -> list[Link]:
        out = []
        for rec in self.records:
            client = NodeClient.for_record(rec, self.keys, timeout=30.0)
            try:
                hello = client.hello()
                if not hello.get("paired_to_you"):
                    raise TuneError(
                        f"{rec.name} ({rec.address}) is not paired with this main PC: pair it again"
                    )
                info = client.info()
            except NodeError as exc:
                client.close()
                raise TuneError(f"{rec.name}: {exc}") from None
            ports = info.get("worker_ports") or [0]
            windows = str((info.get("pc") or {}).get("os", "")).lower().startswith("windows")
            out.append(Link(rec, client, "", port=int(ports[0]), windows=windows))
        return out

    def _ship(self, nodes: list[Link]) -> None:
        """Each PC gets one shard covering its range in every candidate, unless it already holds the whole model
        file (same name and size; the handshake then checks header and weights)."""

        whole = self.model.stat().st_size
        for i, node in enumerate(nodes):
            try:
                files = node.client.files()["files"]
            except NodeError as exc:
                raise TuneError(f"{node.rec.name}: {exc}") from None
            if any(f["name"] == self.model.name and f["size"] == whole and f["complete"] for f in files):
                node.model = self.model.name
                self.log(f"tune: {node.rec.name} holds {self.model.name} already")
                continue
            begin = min(s[i] for s in self.splits)
            end = max((s[i + 1] if i + 1 < len(s) else self.n_layer) for s in self.splits)
            layout = ShardLayout(self.model, begin, end)
            self.log(f"tune: {node.rec.name} needs layers {begin}-{end - 1} ({layout.size / 2**30:.2f} GiB)")
            try:
                res = ship(
                    node.client, self.model, begin, end, layout=layout,
                    progress=lambda done, total: self.progress("ship", done, total),
                )  # fmt: skip
            except NodeError as exc:
                raise TuneError(f"shipping layers to {node.rec.name} failed: {exc}") from None
            node.model = res.name

    def config_for(self, nodes: list[Link], split: tuple[int, ...], chunk: int) -> Any:
        base = self.base
        workers = []
        for i, node in enumerate(nodes):
            end = split[i + 1] if i + 1 < len(split) else self.n_layer
            workers.append(Worker(node.rec.host, node.port, split[i], end))
        args = _drop_flag(list(base.args) if base is not None else [], "--prefill")
        args += ["--prefill", str(chunk)]
        # The main PC runs its layers on one card (or the CPU) next to worker PCs: at most one card is kept.
        return StrataConfig(
            model=str(self.model.resolve()),
            gpu=tuple(base.gpu[:1]) if base is not None else (),
            layer_split="auto",
            gpu_order=base.gpu_order if base is not None else "auto",
            args=tuple(args),
            workers=tuple(workers),
            max_context=self.max_context,
            kv=base.kv if base is not None else None,
        )

    def _measure_split(self, nodes: list[Link], split: tuple[int, ...]) -> list[Measurement]:
        rows: list[Measurement] = []
        cfg = self.config_for(nodes, split, self.chunks[0])
        try:
            cfg = cfg.validate("the candidate config", self.n_layer)
            main = MainStage(cfg, engine_flags(nodes, self.keys), self.device, self.dtype)
        except (ConfigError, TuneError, ValueError, RuntimeError) as exc:
            return [
                Measurement(split, c, n, self.answer, 0.0, 0.0, 0.0, _one_line(exc))
                for c in self.chunks
                for n, _ in self.mix
            ]
        try:
            main.measure(fixed_prompt(self.tokenizer, 8), 2, self.chunks[0])  # warm-up, not counted
            for chunk in self.chunks:
                for n, _ in self.mix:
                    for attempt in (1, 2):  # a second try for a hiccup (the link reconnects by itself)
                        try:
                            pp, tg, secs = main.measure(fixed_prompt(self.tokenizer, n), self.answer, chunk)
                            row = Measurement(split, chunk, n, self.answer, pp, tg, secs)
                            break
                        except (TuneError, ValueError, RuntimeError) as exc:
                            row = Measurement(split, chunk, n, self.answer, 0.0, 0.0, 0.0, _one_line(exc))
                            self.log(
                                f"tune: split {split} chunk {chunk} prompt {n}: try {attempt} failed: {row.error}"
                            )
                    rows.append(row)
                    self.log(_row_text(row))
                    self._step()
        finally:
            main.close()
        return rows

    def _step(self) -> None:
        self._done += 1
        self.progress("measure", self._done, self._total)

    def run(self, config_path: Path | None = None, report_path: Path | None = None) -> TuneResult:
        self._total = len(self.splits) * len(self.chunks) * len(self.mix)
        self._done = 0
        self.progress("measure", 0, self._total)
        nodes = self._connect()
        try:
            self._ship(nodes)
            for split in self.splits:
                self.log(f"tune: split {','.join(map(str, split))}: starting the workers")
                try:
                    for w in start_chain(nodes, split, self.worker_flags, self.lock_clocks, any_port=True):
                        if w not in self.warnings:
                            self.warnings.append(w)
                    for node in nodes:
                        wait_listening(node)
                    self.measurements += self._measure_split(nodes, split)
                except (TuneError, ChainError, NodeError) as exc:
                    self.log(f"tune: split {split} failed: {exc}")
                    self.measurements += [
                        Measurement(split, c, n, self.answer, 0.0, 0.0, 0.0, _one_line(exc))
                        for c in self.chunks
                        for n, _ in self.mix
                    ]
                finally:
                    for problem in stop_chain(nodes):
                        self.log(f"tune: {problem}")
                self._done = len(self.measurements)  # a split that failed counts as measured
                self.progress("measure", self._done, self._total)
            scores: dict[str, float] = {}
            best: tuple[float, tuple[int, ...], int] | None = None
            for split in self.splits:
                for chunk in self.chunks:
                    rows = [m for m in self.measurements if m.split == split and m.chunk == chunk]
                    s = expected_seconds(rows, self.mix)
                    if s is None:
                        continue
                    scores[_key(split, chunk)] = s
                    if best is None or s < best[0]:
                        best = (s, split, chunk)
            result = TuneResult(
                best_split=best[1] if best else None,
                best_chunk=best[2] if best else None,
                best_seconds=best[0] if best else None,
                measurements=self.measurements,
                scores=scores,
                warnings=self.warnings,
                workload=self.mix,
            )
            if best is not None:
                target = config_path or default_config_path(str(self.model))
                result.config_path = write_config(self.config_for(nodes, best[1], best[2]), target)
            rp = report_path or (main_dir() / "tune" / f"tune-{self.model.stem}-{_stamp()}.md")
            rp.parent.mkdir(parents=True, exist_ok=True)
            rp.write_text(self.report(result, nodes), encoding="utf-8")
            rp.with_suffix(".json").write_text(
                json.dumps(
                    {
                        "model": str(self.model),
                        "workload": self.mix,
                        "answer_tokens": self.answer,
                        "measurements": [asdict(m) for m in self.measurements],
                        "scores": scores,
                        "best": {"split": best[1], "chunk": best[2], "seconds": best[0]} if best else None,
                        "warnings": self.warnings,
                        "config": str(result.config_path) if result.config_path else None,
                    },
                    indent=2,
                ),
                encoding="utf-8",
            )
            result.report_path = rp
            return result
        finally:
            for n in nodes:
                n.client.close()

    def report(self, result: TuneResult, nodes: list[Link]) -> str:
        lines = [
            f"# Tuning {self.model.name}",
            "",
            f"{datetime.now(UTC).isoformat(timespec='seconds')}; {self.n_layer} layers; main PC runs layers 0 to the "
            "first number; worker PCs: " + ", ".join(f"{n.rec.name} ({n.rec.address})" for n in nodes) + ".",
            "",
            "Workload: "
            + ", ".join(f"{int(w * 100)}% {n}-token prompts" for n, w in self.mix)
            + f", {self.answer}-token answers (the tuner's own text, prompt cache off).",
            "",
            "| split | chunk | prompt tokens | prefill tok/s | decode tok/s | seconds | note |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for m in self.measurements:
            lines.append(
                f"| {','.join(map(str, m.split))} | {m.chunk} | {m.prompt_tokens} | {m.prefill_tps:.1f} | "
                f"{m.decode_tps:.1f} | {m.seconds:.2f} | {m.error[:120].replace('|', '/')} |"
            )
        lines += ["", "| split | chunk | expected seconds per request |", "|---|---:|---:|"]
        for k, s in sorted(result.scores.items(), key=lambda kv: kv[1]):
            lines.append(f"| {k.split('@')[0]} | {k.split('@')[1]} | {s:.3f} |")
        lines.append("")
        if result.best_split is not None:
            lines.append(
                f"Best: split {','.join(map(str, result.best_split))}, prompt chunk {result.best_chunk} "
                f"({result.best_seconds:.3f} s per request); config: {result.config_path}."
            )
        else:
            lines.append("No configuration completed; no config was written.")
        for w in result.warnings:
            lines += ["", w]
        return "\n".join(lines) + "\n"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:400] or type(exc).__name__


def _key(split: tuple[int, ...], chunk: int) -> str:
    return f"{','.join(map(str, split))}@{chunk}"


def _row_text(m: Measurement) -> str:
    if m.error:
        return f"tune: split {m.split} chunk {m.chunk} prompt {m.prompt_tokens}: failed: {m.error}"
    return (
        f"tune: split {m.split} chunk {m.chunk} prompt {m.prompt_tokens}: prefill {m.prefill_tps:.1f} tok/s, "
        f"decode {m.decode_tps:.1f} tok/s, {m.seconds:.2f} s"
    )


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%d-%H%M%S")


def _default_chunks(longest: int) -> list[int]:
    base = [512, 2048, 5888, 8192]
    out = sorted({min(c, longest) for c in base})
    return out[-3:] if len(out) > 3 else out


def _drop_flag(args: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == flag:
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


# ---------------------------------------------------------------------------------------------------------------
# CLI


def _parse_mix(text: str) -> list[tuple[int, float]]:
    out = []
    for part in text.split(","):
        n, _, w = part.partition(":")
        try:
            out.append((int(n), float(w)))
        except ValueError:
            raise TuneError(f"--mix part {part!r} is not TOKENS:WEIGHT (e.g. 32768:0.5)") from None
    if not out or any(n < 1 or w <= 0 for n, w in out):
        raise TuneError("--mix needs positive token counts and weights, e.g. 8192:0.3,32768:0.5,102400:0.2")
    return out


def _json_out(key: str) -> Any:
    return lambda value: print(json.dumps({"ok": True, key: value}), flush=True)


def _json_progress_lines() -> Any:
    """progress(what, done, total) printing a JSON line each time its percent changes (shipping calls it per
    chunk)."""
    last: dict[str, int] = {}

    def progress(what: str, done: int, total: int) -> None:
        pct = done * 100 // max(total, 1)
        if last.get(what) != pct or done == 0:
            last[what] = pct
            print(
                json.dumps({"ok": True, "progress": {"what": what, "done": done, "total": total}}), flush=True
            )

    return progress


def cmd_tune(args: argparse.Namespace) -> int:
    reg = NodeRegistry()
    nodes = [reg.find(n) for n in args.node] if args.node else [n for n in reg.load() if n.included]
    flags = list(args.worker_flags)
    if flags and flags[0] == "--":
        flags = flags[1:]
    model = Path(args.model)
    if not model.is_file():
        raise TuneError(f"model file {model} does not exist: check --model")
    with GGUFFile.open(model) as gf:
        n_layer = gf.get(f"{gf.architecture}.block_count")
    splits = parse_splits(args.split, int(n_layer), len(nodes) + 1) if args.split else None
    target = Path(args.config) if args.config else config_path(str(model))
    base = None
    if target.exists():
        try:
            base = read_config(target)
        except ConfigError as exc:
            raise TuneError(f"{exc}; fix it or pass another --config") from None
    tuner = Tuner(
        model,
        nodes,
        splits,
        args.chunk,
        _parse_mix(args.mix),
        args.answer_tokens,
        args.max_context,
        flags,
        args.lock_clocks,
        device=args.device,
        dtype=args.dtype,
        base=base,
        # --json (the app): each log line and the progress as JSON lines on stdout, before the answer
        log=_json_out("log") if args.json else None,
        progress=_json_progress_lines() if args.json else None,
    )
    res = tuner.run(target, Path(args.report) if args.report else None)
    data = {
        "best_split": list(res.best_split) if res.best_split else None,
        "best_chunk": res.best_chunk,
        "best_seconds": res.best_seconds,
        "config": str(res.config_path) if res.config_path else None,
        "report": str(res.report_path),
        "warnings": res.warnings,
        "measurements": [asdict(m) for m in res.measurements],
    }
    if args.json:
        failed = (
            {}
            if res.best_split
            else {"error": f"no split could be measured: the report says why ({res.report_path})"}
        )
        print(json.dumps({"ok": res.best_split is not None, **failed, **data}), flush=True)
    else:
        print(res.report_path.read_text(encoding="utf-8") if res.report_path else "")
    return 0 if res.best_split is not None else 1
