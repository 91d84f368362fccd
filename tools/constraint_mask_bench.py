"""Grammar mask cost on the demo vocabulary: `python tools/constraint_mask_bench.py`.

Compiles a JSON schema for the demo target's 49k tokens, then at every state along a valid JSON
text times one mask, the node masks of a chain of the next 8 tokens, and of a 17-node tree (a
chain of 4 with 3 siblings at each level); prints medians and 90th percentiles per node, and
the cost of applying 17 masks to 17 logit rows."""

from __future__ import annotations

import json
import time

import numpy as np

from edgespec import backend, constraint as C
from edgespec.config import models_dir
from edgespec.server.config import DEMO_TARGET
from edgespec.tree import DraftTree
from edgespec.types import ConstraintSpec

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
TEXT = '{"name":"Bob Smith","age":42,"tags":["a","b"]}'


def main() -> None:
    model = backend.Model(models_dir() / DEMO_TARGET)
    t0 = time.perf_counter()
    comp = C.Compiler(C.Vocabulary.from_model(model))
    t1 = time.perf_counter()
    m = comp.matcher(ConstraintSpec("json_schema", json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    print(f"vocabulary {model.n_vocab} tokens: compiler {t1 - t0:.3f} s, schema matcher {(t2 - t1) * 1e3:.2f} ms")
    ids = model.tokenize(TEXT, False, False)
    single, chain, tree = [], [], []
    siblings = model.tokenize(" x,", False, False)
    for k in range(len(ids) - 8):
        m.reset()
        m.commit(ids[:k])
        ch = DraftTree.root(ids[k - 1] if k else 0)
        node = 0
        for j in range(8):
            node = ch.add(node, ids[k + j], point=True)
        tr = DraftTree.root(ids[k - 1] if k else 0)
        node = 0
        for j in range(4):
            nxt = tr.add(node, ids[k + j], point=True)
            for s in siblings:
                if s not in tr.child_tokens(node):
                    tr.add(node, s, point=True)
            node = nxt
        for _ in range(5):
            a = time.perf_counter()
            m.mask()
            single.append(time.perf_counter() - a)
            a = time.perf_counter()
            m.node_masks(ch)
            chain.append((time.perf_counter() - a) / len(ch))
            a = time.perf_counter()
            m.node_masks(tr)
            tree.append((time.perf_counter() - a) / len(tr))
    ms = lambda xs: f"{np.median(xs) * 1e3:.3f} / {np.percentile(xs, 90) * 1e3:.3f}"  # noqa: E731
    print(f"per node, median / p90 ms: one mask {ms(single)}; chain of {len(ch)} {ms(chain)}; tree of {len(tr)} {ms(tree)}")
    rows = np.random.default_rng(0).standard_normal((len(tr), model.n_vocab)).astype(np.float32)
    masks, _ = m.node_masks(tr)
    a = time.perf_counter()
    for _ in range(20):
        C.apply_mask(rows, masks)
    print(f"apply_mask on {len(tr)} rows: {(time.perf_counter() - a) / 20 * 1e3:.3f} ms")
    model.close()


if __name__ == "__main__":
    main()
