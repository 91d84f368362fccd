"""A tiny EAGLE-3 head for the demo target, trained by the real trainer on a few of the target's
own answers (a fixed number of epochs, so the result does not depend on this machine's speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

TRAIN_PROMPTS = 4


@pytest.fixture(scope="session")
def tiny_head(demo_pair, tmp_path_factory) -> dict:
    pytest.importorskip("jax")
    from edgespec.heads.train import TrainSpec, train

    wd: Path = tmp_path_factory.mktemp("tiny-head")
    spec = TrainSpec(target=demo_pair.target, out=wd / "head.gguf", work_dir=wd, epochs=60, distill_prompts=TRAIN_PROMPTS,
                     heldout_prompts=1, max_new=48, text_windows=2, window=64, batch=4, draft_vocab=2048, n_ff=512,
                     hf_dir=wd / "hf", threads=1)
    report = train(spec, log=lambda s: None)
    return {"path": spec.out, "hf": spec.hf_dir, "report": report, "spec": spec, "work": wd}


def synthetic_prompts(n: int) -> list[str]:
    """The tiny head's prompts in train-first order: [0, TRAIN_PROMPTS) trained on, then the one
    held out (the trainer takes category_prompts' first `heldout_prompts` as held out)."""
    from edgespec.heads.prompts import category_prompts

    ps = [p for _, p in category_prompts(TRAIN_PROMPTS + 1)]
    return (ps[1:] + ps[:1] + [p for _, p in category_prompts(n + TRAIN_PROMPTS + 1)][TRAIN_PROMPTS + 1:])[:n]
