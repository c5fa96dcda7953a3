"""The in-place Q4_K CPU kernels (engine/experts/cpu_q4k.py) against gguf-py's dequantizer and the expert math in
float64.

The kernels round the expert input and the gate's output to 8 bits per 256 values (a scale per 256, as llama.cpp's
CPU path does), so a weighted sum of experts is checked by cosine (>= 0.9995 per token) and to 3e-2 of its largest
element, not exactly; the ids, weights and the store's bytes are checked exactly."""

import gguf.quants as gq
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

import engine.experts.cpu_experts as cpu_experts
from engine.experts import cpu_q4k
from engine.experts.cpu_experts import CpuExperts
from engine.gguf.random_blocks import random_blocks
from engine.layers.qtensor import QTensor

pytestmark = pytest.mark.skipif(
    not cpu_q4k.available()[0], reason=f"Q4_K CPU kernels: {cpu_q4k.available()[1]}"
)
E, D, F = 6, 512, 256


def _store(rows: int, cols: int, seed: int, qt: QT = QT.Q4_K) -> tuple[np.ndarray, np.ndarray]:
    raw = np.stack([random_blocks(qt, rows, cols, seed=seed * 100 + e) for e in range(E)])  # [E, rows, bytes]
    return raw, gq.dequantize(raw, qt).astype(np.float64).reshape(E, rows, cols)


@pytest.fixture(scope="module")
def layer() -> tuple[list[np.ndarray], list[np.ndarray]]:
    (g, gr), (u, ur), (dn, dr) = _store(F, D, 1), _store(F, D, 2), _store(D, F, 3)
    return [g, u, dn], [gr, ur, dr]


@pytest.fixture(scope="module")
def layer_q6k_down(layer) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Q4_K_M's layout: gate and up Q4_K, down Q6_K."""
    (raws, refs), (dn, dr) = layer, _store(D, F, 4, QT.Q6_K)
    return [raws[0], raws[1], dn], [refs[0], refs[1], dr]


def _ref(x: np.ndarray, ids: list[int], w: list[float], refs: list[np.ndarray]) -> np.ndarray:
    gr, ur, dr = refs
    out = np.zeros(D)
    for e, we in zip(ids, w, strict=True):
        a = gr[e] @ x
        out += we * (dr[e] @ (a / (1.0 + np.exp(-a)) * (ur[e] @ x)))
    return out


@pytest.mark.parametrize("down", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("ids", [[3], [0, 5], [1, 2, 4], [5, 4, 3, 0]])
def test_mix_matches_float64_reference(layer, layer_q6k_down, ids: list[int], down: str) -> None:
    raws, refs = layer if down == "Q4_K" else layer_q6k_down
    before = [r.copy() for r in raws]
    k = cpu_q4k.Q4KExperts(*raws, d=D, f=F, down_q6k=down == "Q6_K")
    x = np.random.default_rng(len(ids)).standard_normal(D).astype(np.float32)
    w = np.linspace(0.2, 0.6, len(ids)).astype(np.float32)
    out = np.full(D, np.nan, dtype=np.float32)
    k.mix(np.array(ids), w, x, out)
    ref = _ref(x.astype(np.float64), ids, w.tolist(), refs)
    cos = out @ ref / (np.linalg.norm(out) * np.linalg.norm(ref))
    assert cos >= 0.9995, cos  # seen: 0.99977-0.99989 (Q4_K and Q6_K down)
    assert np.abs(out - ref).max() <= 3e-2 * np.abs(ref).max()  # seen: 6e-3 to 1.4e-2
    for a, b in zip(raws, before, strict=True):
        assert np.array_equal(a, b)  # the store is only read


@pytest.mark.parametrize("down", ["Q4_K", "Q6_K"])
def test_rows_of_a_step_match_each_token_alone(layer, layer_q6k_down, down: str) -> None:
    """mix_rows: a batched decode step's (expert, token) pairs, experts shared between rows read once: every row
    bit-identical to that token's own call, and close to the float64 reference."""
    raws, refs = layer if down == "Q4_K" else layer_q6k_down
    k = cpu_q4k.Q4KExperts(*raws, d=D, f=F, down_q6k=down == "Q6_K")
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, D)).astype(np.float32)
    rows = [[3, 0], [0, 5, 3], [], [2]]  # expert 0 and 3 chosen by two rows; row 2 takes nothing
    ids = np.array([e for r in rows for e in r])
    tok = np.array([t for t, r in enumerate(rows) for _ in r])
    w = rng.uniform(0.1, 0.6, ids.size).astype(np.float32)
    out = np.full((4, D), np.nan, dtype=np.float32)
    k.mix_rows(ids, tok, w, x, out)
    for t, r in enumerate(rows):
        alone = np.full(D, np.nan, dtype=np.float32)
        k.mix(np.array(r, dtype=np.int64), w[tok == t], x[t], alone)
        assert np.array_equal(out[t], alone)
        if r:
            ref = _ref(x[t].astype(np.float64), r, w[tok == t].tolist(), refs)
            assert out[t] @ ref / (np.linalg.norm(out[t]) * np.linalg.norm(ref)) >= 0.9995
        else:
            assert not out[t].any()
    with pytest.raises(ValueError, match="token rows"):
        k.mix_rows(ids, tok + 1, w, x, out)


@pytest.mark.parametrize("qt", [QT.Q4_K, QT.Q8_0])
def test_a_step_of_eight_rows_matches_each_row_alone(layer, qt: QT) -> None:
    """Eight rows of three experts each (24 pairs): the rows' and the experts' hidden rows are rounded to 8 bits in
    parallel loops there, on one thread for a single row; the bits are the same."""
    raws = (
        layer[0]
        if qt == QT.Q4_K
        else [_store(F, D, 5, qt)[0], _store(F, D, 6, qt)[0], _store(D, F, 7, qt)[0]]
    )
    qts = [
        QTensor(torch.from_numpy(r), qt, s)
        for r, s in zip(raws, [(E, F, D), (E, F, D), (E, D, F)], strict=True)
    ]
    kernels = CpuExperts.in_place_kernels(*qts, "silu")
    rng = np.random.default_rng(11)
    ids = np.concatenate([rng.choice(E, 3, replace=False) for _ in range(8)])
    tok, w = np.repeat(np.arange(8), 3), rng.uniform(0.1, 0.5, 24).astype(np.float32)
    x = rng.standard_normal((8, D)).astype(np.float32)
    out = np.full((8, D), np.nan, np.float32)
    kernels.mix_rows(ids, tok, w, x, out)
    for t in range(8):
        alone = np.full(D, np.nan, np.float32)
        kernels.mix(ids[tok == t], w[tok == t], x[t], alone)
        assert np.array_equal(out[t], alone)


def test_no_experts_gives_zeros_and_bad_input_says_what(layer) -> None:
    raws, _ = layer
    k = cpu_q4k.Q4KExperts(*raws, d=D, f=F)
    out = np.ones(D, dtype=np.float32)
    k.mix(np.zeros(0, np.int64), np.zeros(0, np.float32), np.ones(D, np.float32), out)
    assert not out.any()
    with pytest.raises(ValueError, match="out of range"):
        k.mix(np.array([E]), np.ones(1, np.float32), np.ones(D, np.float32), out)
    with pytest.raises(ValueError, match=r"down must be uint8 .* \(Q4_K rows\)"):
        cpu_q4k.Q4KExperts(raws[0], raws[1], raws[0], d=D, f=F)
    with pytest.raises(ValueError, match=r"down must be uint8 .* \(Q6_K rows\)"):
        cpu_q4k.Q4KExperts(*raws, d=D, f=F, down_q6k=True)
    with pytest.raises(ValueError, match="multiples of 256"):
        cpu_q4k.Q4KExperts(*raws, d=D + 32, f=F)


def test_cpu_experts_reads_q4k_in_place_and_falls_back_without_the_kernels(layer, monkeypatch) -> None:
    raws, refs = layer
    qts = [
        QTensor(torch.from_numpy(r), QT.Q4_K, s)
        for r, s in zip(raws, [(E, F, D), (E, F, D), (E, D, F)], strict=True)
    ]
    ce = CpuExperts(*qts, experts=[0, 2, 5])
    assert (
        ce.kernels == ("q4k", "q4k") and ce.nbytes == 0 and ce.n_held == 3 and ce.holds(5) and not ce.holds(1)
    )
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(7))
    ids = torch.tensor([[0, 5], [2, 0]])
    w = torch.tensor([[0.7, 0.3], [0.5, 0.5]])
    take = torch.tensor([[True, True], [True, False]])
    y = ce.mix(x, ids, w, take).double().numpy()
    for t, (sel, ws) in enumerate([([0, 5], [0.7, 0.3]), ([2], [0.5])]):
        ref = _ref(x[t].double().numpy(), sel, ws, refs)
        assert y[t] @ ref / (np.linalg.norm(y[t]) * np.linalg.norm(ref)) >= 0.9995
    with pytest.raises(ValueError, match="not held"):
        ce.mix(x[:1], torch.tensor([[1]]), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    monkeypatch.setattr(cpu_experts.cpu_q4k, "available", lambda: (False, "switched off in this test"))
    fallback = CpuExperts(*qts, experts=[0, 2, 5])
    assert fallback.kernels == ("int4", "int4") and fallback.nbytes > 0
    y2 = fallback.mix(x, ids, w, take).double().numpy()
    assert np.abs(y2 - y).max() <= 3e-2 * np.abs(y).max()


@pytest.mark.parametrize("kind", ["Q4_K", "Q4_K + Q6_K down", "Q8_0", "repacked"])
def test_a_mailbox_request_is_answered_as_the_pairs_alone(
    layer, layer_q6k_down, kind: str, monkeypatch
) -> None:
    """serve_box: a decode step's request read straight out of a mailbox row (ids, taken flags and weights at
    their offsets; the layout of engine/kernels/cpu_handoff.py) gives the same bits as mix_rows on the taken
    pairs, whatever kernels hold the layer; nothing taken gives zeros; a bad id says which."""
    raws = {"Q4_K + Q6_K down": layer_q6k_down[0], "Q8_0": [_store(F, D, 5, QT.Q8_0)[0], _store(F, D, 6, QT.Q8_0)[0],
            _store(D, F, 7, QT.Q8_0)[0]]}.get(kind, layer[0])  # fmt: skip
    qt_down = QT.Q6_K if kind == "Q4_K + Q6_K down" else QT.Q8_0 if kind == "Q8_0" else QT.Q4_K
    qt = QT.Q8_0 if kind == "Q8_0" else QT.Q4_K
    qts = [QTensor(torch.from_numpy(r), t, s)
           for r, t, s in zip(raws, [qt, qt, qt_down], [(E, F, D), (E, F, D), (E, D, F)], strict=True)]  # fmt: skip
    if kind == "repacked":
        monkeypatch.setattr(cpu_experts.cpu_q4k, "available", lambda: (False, "switched off in this test"))
    ce = CpuExperts(*qts, experts=range(E))
    want_kernels = {"Q8_0": "blocks", "repacked": "int4"}.get(kind, "q4k")
    assert ce.kernels[0] == want_kernels
    t, k, pm = 3, 2, 16  # three rows of two slots; room for 16 pairs
    at = (8, 8 + pm, 8 + 2 * pm)
    box = np.zeros(64 + (t + 1) * D, np.int32)
    boxf = box.view(np.float32)
    ids = np.array([4, 1, 1, 5, 0, 4], np.int32)  # row 0: 4, 1; row 1: 1, 5; row 2: 0, 4
    taken = np.array([1, 1, 1, 0, 0, 1], np.int32)  # row 2 keeps 0 on the GPU; 5 stays there too
    w = np.array([0.6, 0.4, 0.3, 0.7, 0.2, 0.8], np.float32)
    box[at[0] : at[0] + t * k], box[at[1] : at[1] + t * k], boxf[at[2] : at[2] + t * k] = ids, taken, w
    x = boxf[64 : 64 + t * D].reshape(t, D)
    x[:] = np.random.default_rng(3).standard_normal((t, D)).astype(np.float32)
    y = np.full((t, D), np.nan, np.float32)
    ce.serve_box(box, boxf, at, t * k, k, x, y)
    sel = np.flatnonzero(taken)
    want = np.full((t, D), np.nan, np.float32)
    ce.mix_rows(ids[sel].astype(np.int64), sel // k, w[sel], x.copy(), want)
    assert np.array_equal(y, want) and y[0].any() and y[2].any()
    box[at[1] : at[1] + t * k] = 0
    ce.serve_box(box, boxf, at, t * k, k, x, y)
    assert not y.any()
    if kind != "repacked":  # the repacked copies hold no id outside the layer
        box[at[1]], box[at[0]] = 1, E
        with pytest.raises(ValueError, match=f"expert ids \\[{E}\\] out of range"):
            ce.serve_box(box, boxf, at, t * k, k, x, y)


@pytest.mark.parametrize("servers", [1, 2])
def test_the_step_server_answers_each_post_as_it_comes_without_the_gil(layer, servers: int) -> None:
    """StepServer (the mailbox path of engine/experts/cpu_misses.py): a "device" thread posts each layer's request
    in turn and waits for its answer, as a decode step's launches do; one serve call answers them all, each with
    the bits of the request answered alone (serve_box), a Q4_K layer and a Q8_0 one (the block kernels) alike.
    The poster is a Python thread: it can post only while the server's polling holds no GIL (the server would
    otherwise spin out its whole budget, set to 30 s here, before anyone posted). Two servers (two stages' cards)
    serve from two threads at once, taking turns for the kernels through their shared lock word."""
    import threading
    import time

    q8 = [_store(F, D, 5, QT.Q8_0)[0], _store(F, D, 6, QT.Q8_0)[0], _store(D, F, 7, QT.Q8_0)[0]]
    kernels = []
    for raws, qt in ((layer[0], QT.Q4_K), (q8, QT.Q8_0)):
        qts = [QTensor(torch.from_numpy(r), qt, sh) for r, sh in zip(raws, [(E, F, D), (E, F, D), (E, D, F)], strict=True)]  # fmt: skip
        kernels.append(CpuExperts.in_place_kernels(*qts, "silu"))
    k, most = 2, 3
    pm = most * k
    x_at, ans_at = 32, 32 + most * D
    y_at = ans_at + 16
    words = y_at + most * D
    REQ, TAKE, ROWS, IDS = 0, 2, 4, 8
    rng = np.random.default_rng(5)
    posts, want = [], []  # each step's two requests, made (and answered alone) before the server starts
    for _ in range(3):
        for r in range(2):
            t = int(rng.integers(1, most + 1))
            row = np.zeros(words, np.int32)
            row[IDS : IDS + t * k] = rng.integers(0, E, t * k)
            taken = rng.integers(0, 2, t * k)
            taken[0] = 1
            row[IDS + pm : IDS + pm + t * k] = taken
            rowf = row.view(np.float32)
            rowf[IDS + 2 * pm : IDS + 2 * pm + t * k] = rng.uniform(0.1, 0.5, t * k)
            rowf[x_at : x_at + t * D] = rng.standard_normal(t * D)
            row[ROWS], row[TAKE] = t, int(taken.sum())
            y = np.zeros((t, D), np.float32)
            kernels[r].serve_box(row, rowf, (IDS, IDS + pm, IDS + 2 * pm), t * k, k, rowf[x_at : x_at + t * D].reshape(t, D), y)  # fmt: skip
            posts.append(row)
            want.append(y)
    results, errors = [], []

    def one() -> None:  # a server with its own mailboxes and device, serving from this thread
        try:
            server = cpu_q4k.StepServer(
                kernels, (pm, x_at, ans_at, y_at, k, most, REQ, TAKE, ROWS, IDS), F, D
            )
            server.spin_s = 30.0
            box, done = np.zeros((2, words), np.int32), np.zeros(2, np.int32)
            boxf = box.view(np.float32)
            got: list[np.ndarray] = []

            def device() -> None:
                try:
                    for step in range(1, 4):
                        for r in range(2):
                            time.sleep(0.01)  # the layers before this one
                            row = posts[2 * (step - 1) + r]
                            box[r, 1:] = row[1:]
                            box[r, REQ] = step  # posted, last
                            until = time.monotonic() + 20
                            while box[r, ans_at] != step:
                                assert time.monotonic() < until, "no answer"
                            t = int(row[ROWS])
                            got.append(boxf[r, y_at : y_at + t * D].reshape(t, D).copy())
                except BaseException as e:
                    errors.append(e)

            poster = threading.Thread(target=device)
            poster.start()
            for _ in range(3):
                assert server.serve(box, done, np.array([0, 1]), 0) == 2
            poster.join(timeout=30)
            results.append((got, done.tolist(), int(server.state[cpu_q4k.ST_PAIRS])))
        except BaseException as e:
            errors.append(e)

    t0 = time.monotonic()
    serving = [threading.Thread(target=one) for _ in range(servers)]
    for th in serving:
        th.start()
    for th in serving:
        th.join(timeout=60)
    assert not errors and len(results) == servers
    assert time.monotonic() - t0 < 20  # 30 s of spinning a post had the GIL been held
    for got, done, pairs in results:
        assert len(got) == 6 and all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        assert done == [3, 3] and pairs == sum(int(r[TAKE]) for r in posts)


def test_cpu_misses_by_default_takes_the_layers_read_in_place_only() -> None:
    """--cpu-experts left out: the CPU computes every host-RAM expert of the Q4_K layers (no copy) and nothing of
    the others, which would need a repacked copy; given a fraction, it takes both kinds."""
    pytest.importorskip("triton", reason="the hand-off's mailbox kernels are Triton's")
    from engine.experts.cache import ExpertCache
    from engine.experts.cpu_misses import DEFAULT_RATIO, CpuMisses
    from engine.layers.moe import ExpertWeights

    def layer(qt: QT, seed: int) -> ExpertWeights:
        def stack(n: int, k: int, s: int) -> QTensor:
            raw = np.stack([random_blocks(qt, n, k, seed=s + e) for e in range(E)])
            return QTensor(torch.from_numpy(raw), qt, (E, n, k))

        router = QTensor(torch.randn(E, D).view(torch.uint8).view(E, 4 * D), QT.F32, (E, D))
        return ExpertWeights(
            router=router, gate=stack(F, D, seed), up=stack(F, D, seed + 10), down=stack(D, F, seed + 20)
        )

    layers = {0: layer(QT.Q4_K, 1), 1: layer(QT.Q2_K, 2), 2: layer(QT.Q8_0, 3)}
    cache = ExpertCache(layers, torch.device("cpu"), {0: 2, 1: 2, 2: 2})
    auto = CpuMisses(cache, 1.0, 4, "silu", in_place_only=True)
    assert list(auto.layers) == [0, 2] and auto.ratio == DEFAULT_RATIO  # Q2_K is not read in place
    assert auto.layers[0].kernels == ("q4k", "q4k") and auto.layers[0].n_held == E - 2  # those not in VRAM
    assert (
        auto.layers[2].kernels == ("blocks", "blocks") and auto.layers[2].nbytes == 0
    )  # cpu_blocks' kernels
    # --cpu-experts 1 given: Q2_K's layer too, its rows unpacked into codes by the same kernels
    every = CpuMisses(cache, 1.0, 4, "silu")
    assert sorted(every.layers) == [0, 1, 2] and every.layers[1].kernels == ("blocks", "blocks")
    assert every.layers[1].nbytes == 0  # no copy


def test_requests_from_several_threads_give_the_same_sums(layer) -> None:
    """Stages of a split answer their cards' requests from their own threads: the kernels take one at a time."""
    import threading

    raws, _ = layer
    k = cpu_q4k.Q4KExperts(*raws, d=D, f=F)
    x = np.random.default_rng(9).standard_normal(D).astype(np.float32)
    ids, w = np.array([1, 4]), np.array([0.5, 0.5], np.float32)
    want = np.zeros(D, np.float32)
    k.mix(ids, w, x, want)
    outs = [np.zeros(D, np.float32) for _ in range(4)]

    def run(out: np.ndarray) -> None:
        for _ in range(20):
            k.mix(ids, w, x, out)

    threads = [threading.Thread(target=run, args=(o,)) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in outs:
        assert np.array_equal(o, want)


def test_which_layers_are_read_in_place(layer, layer_q6k_down) -> None:
    """Q4_K gate and up with Q4_K or Q6_K down (Q4_K_M files) and a SiLU gate: in place by cpu_q4k; the other
    types the CPU reads in place too (generic kernels); Q2_K/Q3_K only when asked (unpacked); other gates: not."""

    def qts(raws: list[np.ndarray], down: QT) -> list[QTensor]:
        shapes = [(E, F, D), (E, F, D), (E, D, F)]
        types = [QT.Q4_K, QT.Q4_K, down]
        return [QTensor(torch.from_numpy(r), t, s) for r, t, s in zip(raws, types, shapes, strict=True)]

    q4, q6 = qts(layer[0], QT.Q4_K), qts(layer_q6k_down[0], QT.Q6_K)
    assert CpuExperts.in_place(*q4, "silu") and CpuExperts.in_place(*q6, "silu")
    assert not CpuExperts.in_place(*q4, "gelu_tanh")
    ce = CpuExperts(*q6, experts=range(E))
    assert ce.kernels == ("q4k", "q4k") and ce.q4k is not None and ce.q4k.down_q6k and ce.nbytes == 0
    q8 = QTensor(torch.from_numpy(random_blocks(QT.Q8_0, E * D, F).reshape(E, D, -1)), QT.Q8_0, (E, D, F))
    # other types the CPU reads in place go through engine.kernels.cpu_blocks (test_cpu_blocks.py checks them)
    assert CpuExperts.in_place(q4[0], q4[1], q8, "silu")
    assert type(CpuExperts.in_place_kernels(q4[0], q4[1], q8, "silu")).__name__ == "BlockExperts"
    q2 = QTensor(torch.from_numpy(random_blocks(QT.Q2_K, E * D, F).reshape(E, D, -1)), QT.Q2_K, (E, D, F))
    # Q2_K rows are unpacked into codes first: ~10x an in-place type's time, so not for a card's default share;
    # a CPU model's experts and an explicit --cpu-experts F take them through the same kernels
    assert not CpuExperts.in_place(q4[0], q4[1], q2, "silu")
    assert CpuExperts.in_place(q4[0], q4[1], q2, "silu", unpacked=True)
    assert type(CpuExperts.in_place_kernels(q4[0], q4[1], q2, "silu")).__name__ == "BlockExperts"


def test_cpu_decode_moe_goes_through_the_in_place_kernels(layer_q6k_down, monkeypatch) -> None:
    """A CPU model's MoE block at decode (up to 4 tokens) computes its experts from their blocks in place, unless
    --activations float asks for exact products; longer chunks and layers of other block types keep the
    expert-by-expert path (whose products read the blocks in place too, engine.kernels.cpu_blocks). All agree to
    the 8-bit rounding."""
    import engine.experts.backends as backends
    from engine.experts.backends import CpuInPlaceExperts, choose
    from engine.layers.moe import ExpertMath, ExpertWeights, HostExperts, route

    monkeypatch.setenv("STRATA_ACTIVATIONS", "int8")  # the default; the test suite runs with float
    raws, _ = layer_q6k_down
    types = [QT.Q4_K, QT.Q4_K, QT.Q6_K]
    shapes = [(E, F, D), (E, F, D), (E, D, F)]
    g, u, dn = (QTensor(torch.from_numpy(r), t, s) for r, t, s in zip(raws, types, shapes, strict=True))
    gen = torch.Generator().manual_seed(0)
    router = QTensor(torch.randn(E, D, generator=gen).view(torch.uint8).view(E, 4 * D), QT.F32, (E, D))
    ew = ExpertWeights(router=router, gate=g, up=u, down=dn)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(11))
    w, ids = route(x, router, 2, True)
    experts = choose(ew, ExpertMath(), None, 0)
    assert isinstance(experts, CpuInPlaceExperts)  # chosen at load
    fast = experts.mix(x, w, ids)
    monkeypatch.setenv("STRATA_ACTIVATIONS", "float")  # exact products: expert by expert
    slow = experts.mix(x, w, ids)
    monkeypatch.setenv("STRATA_ACTIVATIONS", "int8")
    monkeypatch.setattr(backends, "IN_PLACE_MAX_ROWS", 0)  # chunks longer than this: expert by expert too,
    by_expert = experts.mix(x, w, ids)  # each expert's rows through the dense CPU kernels (8-bit activations)
    assert not torch.equal(by_expert, slow)
    for t in range(3):
        assert torch.nn.functional.cosine_similarity(by_expert[t], slow[t], dim=0).item() >= 0.999
    assert fast.dtype == slow.dtype == torch.float32 and fast.shape == slow.shape == (3, D)
    for t in range(3):
        # the bound for rounded computation; seen 0.99947-0.99991 per token over 40 routers (this one:
        # 0.99947 at its worst token), 0.9995 held for only 28 of them
        assert torch.nn.functional.cosine_similarity(fast[t], slow[t], dim=0).item() >= 0.999
    q8 = ExpertWeights(router=router, gate=QTensor(torch.from_numpy(random_blocks(QT.Q8_0, E * F, D).reshape(E, F, -1)), QT.Q8_0, (E, F, D)), up=u, down=dn)  # fmt: skip
    assert isinstance(choose(q8, ExpertMath(), None, 0), HostExperts)  # Q8_0 gate: not read in place
