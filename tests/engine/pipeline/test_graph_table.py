"""The table of captured CUDA graphs: a KV cache's graphs go when the cache does (a later cache may be given the
same id(), and replaying a dead cache's graph would write into freed memory); the least recently used go past
MAX_GRAPHS. Plain Python: no GPU needed."""

import gc

from engine.pipeline.cuda_graphs import MAX_GRAPHS, GraphTable


class _Cache:  # stands in for a KVCache: only its identity and lifetime matter here
    pass


def test_a_caches_graphs_go_with_it() -> None:
    table: GraphTable[str] = GraphTable()
    a, b = _Cache(), _Cache()
    table.put(a, 256, "a256")
    table.put(a, 512, "a512")
    table.put(b, 256, "b256")
    assert table.get(a, 512) == "a512" and len(table) == 3
    del a
    gc.collect()
    assert len(table) == 1 and table.get(b, 256) == "b256"


def test_the_least_recently_used_go_first() -> None:
    table: GraphTable[int] = GraphTable()
    c = _Cache()
    for span in range(MAX_GRAPHS):
        table.put(c, span, span)
    assert table.get(c, 0) == 0  # used: now the most recent
    table.put(c, MAX_GRAPHS, MAX_GRAPHS)
    assert len(table) == MAX_GRAPHS
    assert table.get(c, 1) is None and table.get(c, 0) == 0
